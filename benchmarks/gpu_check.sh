#!/usr/bin/env bash
# The GPU check in one command: the gpu-marked tests, then the overhead, attention and Hessian benchmarks on
# CUDA, each printing its table. Run from anywhere on a machine with a CUDA device and the package's
# dependencies (the checkout is put on PYTHONPATH, so no install is needed):
#
#   bash benchmarks/gpu_check.sh            # at most 8 minutes: each part stops at its own limit
#
# Each part has its own time limit, and one that fails does not stop the others; the exit status is non-zero
# if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
failed=()

part() {
    local name=$1 limit=$2
    shift 2
    echo
    echo "=== $name"
    local start=$SECONDS
    if timeout "$limit" "$@"; then
        echo "--- $name: done in $((SECONDS - start)) s"
    else
        echo "--- $name: FAILED (exit $?) after $((SECONDS - start)) s"
        failed+=("$name")
    fi
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PYTHON" -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name(0))"

part "gpu tests" 90 "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests
part "overhead: GPT-2 and nanoGPT, logging step against a training step" 180 \
    "$PYTHON" benchmarks/bench_overhead.py --external --device cuda --contexts 256 1024 --rounds 2 --threads 4
part "attention metrics against svdvals" 60 \
    "$PYTHON" benchmarks/bench_attention_metrics.py --device cuda --sizes 512 --repeats 2
part "long context, blockwise" 45 \
    "$PYTHON" benchmarks/bench_long_context.py --device cuda --sizes 4096 8192 16384
part "Hessian: the monitor against PyHessian and hessian-eigenthings" 100 \
    "$PYTHON" benchmarks/bench_hessian.py --device cuda --runs eos --repeats 2

echo
if ((${#failed[@]})); then
    echo "gpu_check: ${#failed[@]} part(s) failed: ${failed[*]}"
    exit 1
fi
echo "gpu_check: every part passed"
