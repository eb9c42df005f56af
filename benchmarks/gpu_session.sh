#!/usr/bin/env bash
# One call on a lent GPU machine: the compiled Pallas tests, the whole CPU suite under the GPU
# machine's JAX (default backend GPU, so implementation=None runs the Pallas kernels), the
# data-parallel example on every GPU, then the GPU benchmark. Logs go to $OUT.
#   Wheels missing on the GPU image (scikit-learn, pytest-xdist) travel in .whl/ (see docs).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" >> "$OUT/gpu.txt" 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 4 -m gpu tests > "$OUT/gpu_tests.log" 2>&1
timeout 260 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 8 tests > "$OUT/suite.log" 2>&1
timeout 90 python3 examples/data_parallel.py --steps 150 > "$OUT/data_parallel.log" 2>&1
if [ "${BENCH:-0}" = 1 ]; then timeout 200 python3 benchmarks/gpu.py > "$OUT/bench.log" 2>&1; fi
cat "$OUT/gpu.txt"
echo "== gpu tests:"; tail -2 "$OUT/gpu_tests.log"
echo "== suite:"; grep -E "FAILED|ERROR" "$OUT/suite.log" | head -20; tail -1 "$OUT/suite.log"
echo "== data parallel:"; tail -6 "$OUT/data_parallel.log"
if [ "${BENCH:-0}" = 1 ]; then echo "== bench:"; tail -30 "$OUT/bench.log"; fi
