#!/usr/bin/env bash
# Download, into .whl/ (git-ignored), the wheels sp_lab needs that the device machines' image lacks, for
# their Python 3.12 on x86-64 Linux (the device tool's README gives the pip command). The image already
# has torch, numpy, pyarrow, pandas, scikit-learn, tqdm, cloudpickle, narwhals, typing-extensions, packaging
# (KINDS.md, "Python packages already there"), so only polars is missing for the sweeps, tuning and export
# (polars >= 1.34 ships its compiled engine as a second wheel, polars-runtime-32: ~52 MiB together).
# plotly (7.1: 9.2 MiB) is NOT carried: with it the tree would be ~64 MiB, the device tool's limit. It only
# draws the HTML reports, which are rebuilt here from the returned rows (README.md). ipywidgets, anywidget
# and jupyterlab are not needed headless.
#
#   bash benchmarks/multigpu/fetch_wheels.sh      # then carry ".whl" in the device call
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude

# Pinned to what this checkout is tested with here, so the GPU run uses the same code paths.
POLARS=$(python3 -c 'import polars; print(polars.__version__)')
PACKAGES=("polars==$POLARS")
# polars >= 1.34 ships its engine as a separate wheel, pinned to the same version.
if python3 -c 'import importlib.util, sys; sys.exit(0 if importlib.util.find_spec("_polars_runtime_32") or importlib.util.find_spec("polars_runtime_32") else 1)'; then
    PACKAGES+=("polars-runtime-32==$POLARS")
fi

mkdir -p .whl
rm -f .whl/*.whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
    -d .whl "${PACKAGES[@]}"

echo "wheels in .whl/ (carry \".whl\" in the device call):"
ls -l .whl/*.whl | awk '{printf "  %8.1f MiB  %s\n", $5 / 1048576, $9}'
for w in .whl/*.whl; do
    unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | sed "s|^|  $(basename "$w"): |" || true
done
du -sh .whl | awk '{print "total: " $1}'
