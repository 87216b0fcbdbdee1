#!/usr/bin/env bash
# Everything GPU in one call: the GPU tests, then the GPU benchmarks; logs and JSON into $OUT
# (or the folder given as $1). On the lent H200:  bash benchmarks/gpu_suite.sh
# Carried wheels in .whl/ (pytest-asyncio, pytest; fastsafetensors and runai-model-streamer for the
# cold-load comparison) are installed to /tmp/site first. Set SKIP_BENCH=1 to skip gpu_bench.py.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-${1:-benchmarks/results/gpu-$(date +%F)}}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if compgen -G ".whl/*.whl" >/dev/null; then
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
{
  date -u; nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,memory.used --format=csv
  python3 -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "python", sys.version.split()[0])'
  python3 -c 'import cuda.bindings, pytest, pytest_asyncio; print("cuda-bindings", cuda.bindings.__version__, "pytest", pytest.__version__, "pytest-asyncio", pytest_asyncio.__version__)'
  nproc; free -g; df -h /tmp | tail -1
} 2>&1 | tee "$OUT/env.txt"

status=0
echo "== benchmarks/gpu_bench.py" | tee "$OUT/gpu_bench.log"
[ "${SKIP_BENCH:-0}" = 1 ] || timeout "${BENCH_TIMEOUT:-380}" python3 benchmarks/gpu_bench.py --out "$OUT/gpu_bench.json" --work /tmp/wcache-bench 2>&1 \
  | tee -a "$OUT/gpu_bench.log" || status=1
tail -n 40 /tmp/wcache-bench/logs/*.log > "$OUT/daemons.log" 2>&1

echo "== benchmarks/cold_load_bench.py" | tee "$OUT/cold_load.log"
timeout "${COLD_TIMEOUT:-240}" python3 benchmarks/cold_load_bench.py --device cuda:0 --out "$OUT/cold_load.json" \
  --work /tmp/wcache-bench 2>&1 | tee -a "$OUT/cold_load.log" || status=1

echo "== tests/gpu" | tee "$OUT/gpu_tests.log"
timeout "${TESTS_TIMEOUT:-190}" python3 -m pytest tests/gpu -q -p no:cacheprovider -o addopts="" --strict-markers -ra -W default \
  --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee -a "$OUT/gpu_tests.log" || status=1
exit $status
