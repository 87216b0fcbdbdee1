#!/usr/bin/env bash
# TP=2 across two GPUs (nvidia-h200-x2): two daemons on two GPUs with permuted CUDA_VISIBLE_DEVICES,
# per-rank engines, one process gathering both ranks, TP=2 forward vs TP=1. JSON and logs into $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-${1:-benchmarks/results/gpu-tp2-$(date +%F)}}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=index,name,uuid,memory.used --format=csv 2>&1 | tee "$OUT/env-tp2.txt"
nvidia-smi topo -m >> "$OUT/env-tp2.txt" 2>&1
timeout "${TP2_TIMEOUT:-500}" python3 benchmarks/tp2_bench.py --out "$OUT/tp2_bench.json" --work /tmp/wcache-bench 2>&1 \
  | tee "$OUT/tp2_bench.log"
status=${PIPESTATUS[0]}
tail -n 30 /tmp/wcache-bench/logs/daemon-tp2-*.log > "$OUT/daemons-tp2.log" 2>&1
exit $status
