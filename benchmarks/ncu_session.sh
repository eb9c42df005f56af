#!/usr/bin/env bash
# On a lent GPU machine, from the repository root (logs under $OUT): an Nsight Compute profile of
# each kernel (profile_gpu.py runs each twice: both calls are profiled) with the shipped table's
# launches, as CSV ($OUT/ncu.csv). CASES (default: the 3x3/s2 channels_last case and the 3-D one), DTYPES
# (default: every dtype of those cases).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAXPOOL_TUNE=${JAXPOOL_TUNE:-cached}
CASES=${CASES:-128x112x112x64,3x3x3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,\
lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sector_hit_rate.pct,\
l1tex__t_sector_hit_rate.pct,l1tex__throughput.avg.pct_of_peak_sustained_active,\
launch__registers_per_thread,launch__grid_size,launch__block_size,\
sm__warps_active.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active,\
smsp__inst_executed.sum,\
smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,\
smsp__average_warps_issue_stalled_drain_per_issue_active.ratio
timeout 300 ncu --clock-control none --csv -k regex:jaxpool --metrics "$METRICS" \
  python3 benchmarks/profile_gpu.py --cases "$CASES" ${DTYPES:+--dtypes $DTYPES} \
  > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
echo "ncu: exit $?"
