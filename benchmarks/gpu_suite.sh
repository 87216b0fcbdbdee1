#!/usr/bin/env bash
# Everything GPU in one script: the GPU tests, then the GPU benchmarks; logs and JSON into $OUT
# (or the folder given as $1). On the lent H200:  bash benchmarks/gpu_suite.sh
# PARTS picks steps (default: all, about 29 min): bench tests sweep cold disk driver_order first_token kills tier handoff fresh restart imports fresh_moe fp8 fleet.
# The lent machine caps one call at 10 min, so it is run there in two calls, e.g.
#   PARTS="bench tests" bash benchmarks/gpu_suite.sh   then   PARTS="sweep cold first_token kills" ...
# Carried wheels in .whl/ (pytest-asyncio, pytest; fastsafetensors and runai-model-streamer for the
# cold-load comparison) are installed to /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-${1:-benchmarks/results/gpu-$(date +%F)}}"
PARTS="${PARTS:-bench tests sweep cold disk driver_order first_token kills tier handoff fresh restart imports fresh_moe fp8 fleet}"
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
  python3 -c 'import cuda.bindings, pytest, pytest_asyncio, transformers; print("cuda-bindings", cuda.bindings.__version__, "pytest", pytest.__version__, "pytest-asyncio", pytest_asyncio.__version__, "transformers", transformers.__version__)'
  nproc; free -g; df -h /tmp | tail -1
} 2>&1 | tee "$OUT/env.txt"

status=0
want() { [[ " $PARTS " == *" $1 "* ]]; }
step() {  # step NAME TIMEOUT_S COMMAND... : log into $OUT/NAME.log, never longer than TIMEOUT_S
  local name=$1 limit=$2; shift 2
  echo "== $name ($(date -u +%T), limit ${limit}s)" | tee "$OUT/$name.log"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$name.log" || { echo "== $name FAILED or timed out" | tee -a "$OUT/$name.log"; status=1; }
}
W=/tmp/wcache-bench
if want bench; then
  step gpu_bench "${BENCH_TIMEOUT:-400}" python3 benchmarks/gpu_bench.py --out "$OUT/gpu_bench.json" --work $W
  tail -n 40 $W/logs/*.log > "$OUT/daemons.log" 2>&1
fi
if want tests; then
  step gpu_tests "${TESTS_TIMEOUT:-190}" python3 -m pytest tests/gpu -q -p no:cacheprovider -o addopts="" --strict-markers -ra \
    -W default --junitxml="$OUT/gpu_tests.xml"
fi
if want sweep; then
  step load_sweep "${SWEEP_TIMEOUT:-200}" python3 benchmarks/load_sweep.py --device cuda:0 --model $W/llama3-8b --out "$OUT/load_sweep.json"
fi
if want cold; then
  # the daemon's --threads: the sweep's fastest cold setting when the sweep ran. Issue 20's read-pattern
  # comparison alone (about 3 min, more when the checkpoint must be generated first: COLD_TIMEOUT=360):
  #   COLD_ARGS="--only wcache wcache_stream wcache_stream_512k wcache_stream_4m fastsafetensors disk_direct disk_direct_512k"
  T=$(python3 -c 'import json,sys; print(min(json.load(open(sys.argv[1]))["cold"], key=lambda r: r["seconds"])["threads"])' \
      "$OUT/load_sweep.json" 2>/dev/null)
  step cold_load "${COLD_TIMEOUT:-240}" python3 benchmarks/cold_load_bench.py --device cuda:0 --work $W --out "$OUT/cold_load.json" \
    ${T:+--threads $T} ${COLD_ARGS:-}
fi
if want disk; then
  # which read pattern the disk serves fastest cold, fastsafetensors before and after as the noise band,
  # the block queue settings and what cuFile reports (issue 20; about 2 min for 16 GB)
  [ -f $W/llama3-8b/config.json ] || timeout 300 python3 -c "from wcache.synthetic import LLAMA3_8B, make_llama_checkpoint as m; from pathlib import Path; m(Path('$W/llama3-8b'), LLAMA3_8B, shards=4, seed=0, device='cuda:0')"
  step disk_pattern "${DISK_TIMEOUT:-300}" python3 benchmarks/disk_pattern_bench.py --device cuda:0 --model $W/llama3-8b \
    --out "$OUT/disk_pattern.json" ${DISK_ARGS:-}
fi
if want driver_order; then
  # start-up order (cuda-bindings / ctypes driver calls before torch) against host-to-device copy speed
  step driver_order "${DRIVER_ORDER_TIMEOUT:-120}" python3 benchmarks/driver_order_probe.py --out "$OUT/driver_order.json"
fi
if want first_token; then
  step first_token "${FIRST_TOKEN_TIMEOUT:-150}" python3 benchmarks/first_token_bench.py --device cuda:0 --model $W/llama3-8b \
    --out "$OUT/first_token.json"
fi
if want kills; then
  step kills "${KILLS_TIMEOUT:-150}" python3 benchmarks/reliability.py --device cuda:0 --only kills --kills 100 \
    --out "$OUT/reliability_kills.json"
fi
if want tier; then
  [ -f $W/llama3-8b/config.json ] || timeout 300 python3 -c "from wcache.synthetic import LLAMA3_8B, make_llama_checkpoint as m; from pathlib import Path; m(Path('$W/llama3-8b'), LLAMA3_8B, shards=4, seed=0, device='cuda:0')"
  step tier_reload "${TIER_TIMEOUT:-300}" python3 benchmarks/tier_reload_bench.py --device cuda:0 --model $W/llama3-8b \
    --out "$OUT/tier_reload.json" ${TIER_ARGS:-}
fi
if want handoff; then
  step handoff "${HANDOFF_TIMEOUT:-240}" python3 benchmarks/handoff_bench.py --device cuda:0 --model $W/llama3-8b \
    --out "$OUT/handoff.json"
fi
if want fresh; then
  # a restart is a first fetch in a fresh engine, imports included (issue 20): 16 GB Llama (with the
  # anchors' per-tensor IPC baseline in the same run), then the 50,000-tensor layout
  [ -f $W/llama3-8b/config.json ] || timeout 300 python3 -c "from wcache.synthetic import LLAMA3_8B, make_llama_checkpoint as m; from pathlib import Path; m(Path('$W/llama3-8b'), LLAMA3_8B, shards=4, seed=0, device='cuda:0')"
  step fresh_engine "${FRESH_TIMEOUT:-300}" python3 benchmarks/fresh_engine_bench.py --device cuda:0 --work $W \
    --model $W/llama3-8b --out "$OUT/fresh_engine.json" ${FRESH_ARGS:-}
fi
if want restart; then
  # daemon SIGKILLed and restarted on its keeper: process start -> ready, no torch (issue 20)
  [ -f $W/llama3-8b/config.json ] || timeout 300 python3 -c "from wcache.synthetic import LLAMA3_8B, make_llama_checkpoint as m; from pathlib import Path; m(Path('$W/llama3-8b'), LLAMA3_8B, shards=4, seed=0, device='cuda:0')"
  step keeper_restart "${RESTART_TIMEOUT:-200}" python3 benchmarks/keeper_restart_bench.py --device cuda:0 --model $W/llama3-8b \
    --out "$OUT/keeper_restart.json"
fi
if want imports; then
  # what the restart path imports, and what each module costs on this machine (python -X importtime)
  step importtime 60 python3 -X importtime -c "import torch; import wcache; from wcache import WCacheClient, WeightCacheKey; from wcache.client import mapping"
fi
if want fresh_moe; then
  step fresh_engine_moe "${FRESH_MOE_TIMEOUT:-240}" python3 benchmarks/fresh_engine_bench.py --device cuda:0 --work $W \
    --moe --out "$OUT/fresh_engine_moe.json"
fi
if want fp8; then
  # issue 17 on the GPU: a block-wise FP8 checkpoint served zero_copy (bytes checked) and CUDA write-back
  # (tests, JSON from their junit: none may skip here); then transformers' FP8 quantize-on-load deposited
  # by start 1 and mapped zero_copy by start 2, every parameter bit-identical, both starts timed
  step fp8_checkpoint "${FP8_TESTS_TIMEOUT:-200}" python3 -m pytest tests/gpu/test_fp8.py tests/gpu/test_deposit_cuda.py \
    -q -p no:cacheprovider -o addopts="" --strict-markers -ra -W default --junitxml="$OUT/fp8_tests.xml"
  python3 - "$OUT/fp8_tests.xml" "$OUT/fp8_checkpoint.json" <<'PY' || status=1
import json, sys, xml.etree.ElementTree as ET
cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
res = {c.get("classname", "") + "::" + c.get("name", ""): next((k.tag for k in c if k.tag in ("failure", "error", "skipped")), "passed") for c in cases}
out = {"step": "fp8_checkpoint", "tests": len(res), "passed": sum(v == "passed" for v in res.values()), "results": res}
out["ok"] = out["tests"] > 0 and out["passed"] == out["tests"]
open(sys.argv[2], "w").write(json.dumps(out, indent=2) + "\n"); print(json.dumps({k: out[k] for k in ("tests", "passed", "ok")}))
sys.exit(0 if out["ok"] else 1)
PY
  step fp8_writeback "${FP8_WB_TIMEOUT:-400}" python3 benchmarks/fp8_writeback_bench.py --device cuda:0 --work /tmp/wcache-fp8wb \
    --out "$OUT/fp8_writeback.json" ${FP8_WB_ARGS:-}
fi
if want fleet; then
  # fleet fill over NIXL (docs/fleet.md, "What is measured"): raw NIXL READ between two processes of 16 GB host
  # slabs, then 16 GB VMM slabs on the GPU, the dim-1 shard comparison on each, and the fill itself — a source
  # daemon (--peer-listen) with the 16 GB Llama, raw READs of its slab and fills of the same bytes alternating
  # (fill_over_nixl_raw), then 1 and 2 target daemons at once; with UCX's own transport choice (one host: shared
  # memory / CUDA IPC) and the raw READ with TCP only, as between hosts without RDMA (about 7 min in all).
  # Needs NIXL for CUDA 13: carry nixl_cu13-1.5.1-cp312-*.whl in .whl/ (installed to /tmp/site).
  python3 -c 'import nixl_cu13' 2>/dev/null || { echo "== fleet: nixl_cu13 is not installed (carry its wheel in .whl/)" | tee "$OUT/fleet.log"; status=1; }
  [ -f $W/llama3-8b/config.json ] || timeout 300 python3 -c "from wcache.synthetic import LLAMA3_8B, make_llama_checkpoint as m; from pathlib import Path; m(Path('$W/llama3-8b'), LLAMA3_8B, shards=4, seed=0, device='cuda:0')"
  step fleet_host "${FLEET_HOST_TIMEOUT:-240}" python3 benchmarks/fleet_fill_bench.py --device cpu --gib 16 --chunk 64M,1G \
    --reps 2 --fill $W/llama3-8b --targets 1,2 --work /tmp/wcache-fleet --out "$OUT/fleet_fill-host.json"
  step fleet_host_tcp "${FLEET_TCP_TIMEOUT:-120}" env UCX_TLS=tcp python3 benchmarks/fleet_fill_bench.py --device cpu \
    --gib 16 --chunk 64M --reps 1 --out "$OUT/fleet_fill-host-tcp.json"
  step fleet_gpu "${FLEET_GPU_TIMEOUT:-240}" python3 benchmarks/fleet_fill_bench.py --device cuda:0 --gib 16 --chunk 64M \
    --reps 1 --fill $W/llama3-8b --targets 1 --work /tmp/wcache-fleet --out "$OUT/fleet_fill-cuda.json"
  step fleet_gpu_tcp "${FLEET_TCP_TIMEOUT:-120}" env UCX_TLS=tcp,cuda_copy python3 benchmarks/fleet_fill_bench.py \
    --device cuda:0 --gib 16 --chunk 64M --reps 1 --out "$OUT/fleet_fill-cuda-tcp.json"
fi
exit $status
