#!/usr/bin/env bash
# Four single-H200 benchmarks (attention, tp 1 latency, GPU verification, rehearsal numerics) and the GPU test
# suite in one run on one H200. It writes four of the files under data/h200/; the matmul tables come from
# benchmarks/bench_matmul_h200.py and benchmarks/bench_matmul_fp8_h200.py (which also writes rehearsal_fp8.json),
# and gemm_chunking_tp8.json and symm_mem_ws1.json from no script in the repository.
#
#   bash benchmarks/h200/run.sh        # on one GPU; polars wheels in .whl/ ($WHEELS) where polars is missing
#   ONLY="verify_gpu_timed rehearsal" bash benchmarks/h200/run.sh   # some steps only (names as in step below)
#   ONLY=rehearsal REHEARSAL_LIMIT=560 REHEARSAL_CASE_TIMEOUT=400 bash benchmarks/h200/run.sh
#
# Writes to $OUT (default out/h200): attention.json, tp1_latency.json, verify_gpu.json (commit as
# verify_gpu_h200.json), rehearsal_numerics.json, and logs/ (run.log with every step's exit code,
# timed_steps.log, rehearsal.log, pytest_gpu.log).
# Timed steps run alone on the GPU; the two untimed ones (rehearsal numerics, pytest -m gpu) run last,
# side by side, since they are bound by compiling on the CPU. pytest leaves out the rehearsed compiles
# (test_compiled_tp_model_...), which rehearsal_numerics.py runs with the same cases and bounds.
set -uo pipefail
cd "$(dirname "$0")/../.."

source benchmarks/gpu_env.sh  # multicast off, one Inductor cache, the wheels in $WHEELS
OUT=${OUT:-out/h200}
LOGS=$OUT/logs
mkdir -p "$OUT" "$LOGS"
export SP_LAB_BENCH_COMMAND="bash benchmarks/h200/run.sh (one NVIDIA H200)"

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$LOGS/run.log"
python3 -c 'import torch, polars; print("torch", torch.__version__, "cuda", torch.version.cuda, "polars", polars.__version__)' \
    | tee -a "$LOGS/run.log"

step() {  # step NAME TIMEOUT_S COMMAND...: run, log to $OUT/NAME.log, record the exit code in run.log
    local name=$1 limit=$2; shift 2
    if [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then echo "$name: skipped (ONLY=$ONLY)" >>"$LOGS/run.log"; return; fi
    local start=$SECONDS
    timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc after $((SECONDS - start)) s" | tee -a "$LOGS/run.log"
    tail -n 25 "$LOGS/$name.log"
}

step attention_timed 90 python3 benchmarks/h200/bench_attention.py
step tp1_latency_timed 200 python3 benchmarks/h200/bench_tp1_latency.py
step verify_gpu_timed 120 python3 benchmarks/verify_gpu.py
step rehearsal "${REHEARSAL_LIMIT:-330}" python3 benchmarks/h200/rehearsal_numerics.py --case-timeout "${REHEARSAL_CASE_TIMEOUT:-300}" &
step pytest_gpu 200 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not compiled_tp_model" tests &
wait
# The timed steps' logs are joined into one file, timed_steps.log.
(cd "$LOGS" && cat ./*_timed.log > timed_steps.log 2>/dev/null; rm -f ./*_timed.log)
echo "== run.log"; cat "$LOGS/run.log"
