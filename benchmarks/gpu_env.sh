# Sourced by the GPU run scripts (benchmarks/h200/run.sh, benchmarks/multigpu/run.sh) from the repository root:
# the environment every process they start inherits, and the packages the GPU image lacks.
#
# NVLink multicast stays off in NCCL, PyTorch and NVSHMEM: a program that uses it can take the host's shared
# GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
# One Inductor/Triton cache for every job of the run: later jobs reuse the kernels of earlier ones.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/sp_lab_inductor}

# Packages the GPU image lacks (polars) can be sent along as wheels in $WHEELS (default .whl).
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
        || { echo "$0: installing the carried wheels failed" >&2; exit 3; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
