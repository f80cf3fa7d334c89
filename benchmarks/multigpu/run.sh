#!/usr/bin/env bash
# Issue #7 in one device call: SP+AsyncTP vs plain TP sweeps on every (model, tp, boundary) that fits the
# visible GPUs, inside a time budget, with the results packed into $OUT (see README.md beside this file).
#
#   bash benchmarks/multigpu/run.sh            # on the device machine; the device tool's carry: [".whl"]
#   BUDGET_S=400 ONLY=llama-3-8b bash benchmarks/multigpu/run.sh
#
# Environment: OUT (where results go; the device tool sets it), BUDGET_S (seconds for everything,
# default 540 = 9 minutes, inside the tool's 10-minute limit), ONLY (comma-separated planned models),
# PROFILE (gpu, or cpu for a dry run), GPUS (devices to plan for; default: the GPUs torch sees).
set -uo pipefail
cd "$(dirname "$0")/../.."

# NVLink multicast stays off in NCCL, PyTorch and NVSHMEM, for this process and every one it starts:
# a program that uses it can take the host's shared GPUs out of service (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
# One Inductor/Triton cache for every job: the second boundary's baseline and the tuned variant reuse kernels.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/sp_lab_inductor}

OUT=${OUT:-out/multigpu}
mkdir -p "$OUT"

# Packages the GPU image lacks (polars) travel as wheels in .whl (benchmarks/multigpu/fetch_wheels.sh).
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "run.sh: installing the carried wheels failed" >&2; exit 3; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

python3 - <<'PY' || { echo "run.sh: a package sp_lab needs is missing: carry .whl (fetch_wheels.sh)" >&2; exit 3; }
import importlib
for name in ("torch", "polars", "pyarrow", "sklearn", "tqdm", "cloudpickle", "sp_lab.cli"):
    importlib.import_module(name)
import torch
print(f"run.sh: torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} GPU(s) visible")
PY

python3 benchmarks/multigpu/plan.py run \
    --profile "${PROFILE:-gpu}" \
    --budget-s "${BUDGET_S:-540}" \
    --out "$OUT" \
    --work "${WORK:-/tmp/sp_lab_multigpu}" \
    ${ONLY:+--only "$ONLY"} \
    ${GPUS:+--gpus "$GPUS"} \
    2>&1 | tee "$OUT/run.log"
