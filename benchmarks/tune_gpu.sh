#!/usr/bin/env bash
# On a lent GPU machine (one GPU), from the repository root; logs and results under $OUT:
#   1. tunes every kernel of benchmarks/pooling_gpu.py's cases from an empty cache (python -m
#      jaxpool.tune --retune) and reports the time (tune.log, tune_<gpu>.json);
#   2. writes the shipped table of this device kind into the package
#      (jaxpool/_src/pallas/tuning/launch_tables/<device kind>.json) and a copy to $OUT;
#   3. runs benchmarks/pooling_gpu.py with that table only (an empty cache, JAXPOOL_TUNE=cached: no
#      tuning), which prints each kernel row's configuration and where it came from, and the
#      kernel rows below 0.85 of the copy bandwidth (bench.log, pooling_gpu_<gpu>.json).
# <gpu> names the device kind in short (h200, h100: benchmarks/result_path.py): copy the two JSON
# files over benchmarks/results/'s of the same names to commit them as the current run.
# Budget: TUNE_BUDGET_S seconds a kernel (default 12) for 30 kernels, at most 6 candidates each:
# most kernels take 1-4 s, about 2 minutes in all on an H100 or H200 (the heuristic's compile is
# always waited for, so a case's first kernel can take longer; with 6 s, several of them had
# only the heuristic timed, with 12 s one or two); pooling_gpu.py (no PyTorch rows) takes 2-3.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" >> "$OUT/gpu.txt" 2>&1
cat "$OUT/gpu.txt"
TABLE=jaxpool/_src/pallas/tuning/launch_tables/$(python3 -c "import jax
from jaxpool._src.pallas.tuning.tuner import table_name
print(table_name(jax.devices()[0].device_kind))")
GPU=$(python3 -c "import jax, sys; sys.path.insert(0, 'benchmarks')
from result_path import device_tag
print(device_tag(jax.devices()[0].device_kind))")
rm -rf "$OUT/cache_tune" "$OUT/cache_empty"
t0=$(date +%s)
JAXPOOL_CACHE_DIR=$OUT/cache_tune timeout 420 python3 -m jaxpool.tune --preset gpu-benchmark \
  --retune --budget-s "${TUNE_BUDGET_S:-12}" --write-table "$TABLE" --json "$OUT/tune_$GPU.json" \
  > "$OUT/tune.log" 2>&1
echo "tune: exit $?, $(( $(date +%s) - t0 )) s wall (process start included)" | tee -a "$OUT/tune.log"
cp "$TABLE" "$OUT/" 2>/dev/null
JAXPOOL_CACHE_DIR=$OUT/cache_empty JAXPOOL_TUNE=cached timeout 240 python3 benchmarks/pooling_gpu.py \
  --no-torch --json "$OUT/pooling_gpu_$GPU.json" --png "$OUT/bench_gpu.png" > "$OUT/bench.log" 2>&1
echo "pooling_gpu.py: exit $?"
echo "== tune:"; tail -4 "$OUT/tune.log"
echo "== bench:"; grep -E "^device|^launch|^copy" "$OUT/bench.log"; tail -20 "$OUT/bench.log"
