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

source benchmarks/gpu_env.sh  # multicast off, one Inductor cache, the carried wheels (fetch_wheels.sh)

OUT=${OUT:-out/multigpu}
mkdir -p "$OUT"

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
