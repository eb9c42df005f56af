#!/usr/bin/env bash
# Calls on a lent GPU machine, logs under $OUT.
#   PART=tests: the compiled Pallas tests, then the whole CPU suite (the tests marked slow
#     included) under the GPU machine's JAX (default backend GPU, so implementation=None runs
#     the Pallas kernels).
#   PART=bench: benchmarks/pooling_gpu.py (kernels against XLA and PyTorch), the fused ReLU and
#     jaxpool.optimize benchmarks, global/adaptive pooling, and the unroll threshold.
# Wheels missing on the GPU image travel in .whl/ (see docs/compatibility.md).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
if [ "${PART:-tests}" = tests ]; then
  # The tests run the heuristic launch configurations (tuning every test shape would cost
  # minutes); tests/kernels/test_tuning.py sets its own.
  export JAXPOOL_TUNE=${JAXPOOL_TUNE:-off}
  timeout 300 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 6 -m gpu tests \
    > "$OUT/gpu_tests.log" 2>&1
  timeout 330 python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 12 -m "not gpu" tests \
    --ignore=tests/project/packaging_check.py > "$OUT/suite.log" 2>&1  # (-m "not gpu": slow ones too)
  echo "== gpu tests:"; grep -E "FAILED|ERROR" "$OUT/gpu_tests.log" | head; tail -1 "$OUT/gpu_tests.log"
  echo "== suite:"; grep -E "FAILED|ERROR" "$OUT/suite.log" | head -30; tail -1 "$OUT/suite.log"
else
  # pooling_gpu.py: the shipped table's launch configurations (its cases are the table's keys;
  # tuning every kernel here would not fit the timeouts; benchmarks/tune_gpu.sh tunes, then
  # benchmarks). The other scripts run the library's default mode (the table, else the launch
  # model: what a user's call gets), unless JAXPOOL_TUNE is set.
  JAXPOOL_TUNE=${JAXPOOL_TUNE:-cached} timeout 200 python3 benchmarks/pooling_gpu.py \
    > "$OUT/bench.log" 2>&1
  [ -f benchmarks/optimize_gpu.py ] && timeout 220 python3 benchmarks/optimize_gpu.py \
    > "$OUT/optimize.log" 2>&1
  timeout 90 python3 benchmarks/global_adaptive.py > "$OUT/global_adaptive.log" 2>&1
  timeout 60 python3 benchmarks/unroll_threshold.py --quick > "$OUT/unroll.log" 2>&1
  # (each script writes benchmarks/results/<script>_<gpu>.json: benchmarks/result_path.py)
  for f in benchmarks/results/pooling_gpu_*.json benchmarks/results/optimize_gpu_*.json \
           benchmarks/results/global_adaptive_*.json benchmarks/results/unroll_threshold_*.json; do
    cp "$f" "$OUT/" 2>/dev/null
  done
  echo "== bench:"; tail -25 "$OUT/bench.log"
  echo "== optimize:"; tail -30 "$OUT/optimize.log" 2>/dev/null
  echo "== global/adaptive:"; tail -22 "$OUT/global_adaptive.log"
  echo "== unroll:"; tail -12 "$OUT/unroll.log"
fi
