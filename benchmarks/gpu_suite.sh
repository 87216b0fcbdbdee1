#!/usr/bin/env bash
# Everything GPU in one script: the GPU tests, then the GPU benchmarks. On the lent H200:
#   PARTS=restart bash benchmarks/gpu_suite.sh          # one device call, ~8 min (16 GB checkpoint generated)
#
# PARTS picks steps, or one of three sets, each made to fit one 10-minute device call (expected minutes on the
# H200, setup and the 16 GB checkpoint's ~25 s generation included; a fresh machine per call):
#   restart  tests fresh keeper imports                ~8    the restart path: GPU tests (FP8 ones included: their
#                                                            JSON too), fresh engines, keeper restart, imports
#   moe      fresh_moe                                 ~2.5  the 50,000-tensor MoE restart path (a call of its own, or
#                                                            beside another set with room)
#   loads    cold sweep first_token tier               ~8.5  cold/warm loads, first token, host tier
#   more     bench kills handoff fp8_writeback         ~8    the all-in-one bench, kills, takeover, FP8 write-back
# so the whole suite is four calls: PARTS=restart, moe, loads, more. Default: all four sets (more than
# one call's time: what does not fit SUITE_SECONDS is skipped and says so). Extra steps, in no set: disk
# (the disk's read patterns, ~3 min), driver_order (start-up order vs copy speed, ~1 min), and fleet (the
# fleet fill over NIXL, docs/fleet.md "What is measured": ~7 min with the checkpoint's generation, so a call
# of its own; needs NIXL for CUDA 13, its wheel carried in .whl/), and fleet_host (its host-slab half alone, e.g.
# with FLEET_HOST_REPS=3 FLEET_HOST_TIMEOUT=300):
#   PARTS=fleet bash benchmarks/gpu_suite.sh              # one device call: 319 s on the H200 (2026-12-02, FLEET_TCP=1)
#
# Every step runs under its own limit (NAME_TIMEOUT, defaults below: each fits its default work with margin)
# and under the suite's deadline, SUITE_SECONDS (default 570) from the start: a step gets at most what is left,
# and one that cannot start in time is skipped, so a call always ends, and packs its results, inside 10 minutes.
#
# Output: $OUT (or $1; default benchmarks/results/gpu-DATE) gets two files, fit for a device call's $OUT (at
# most 8 files come back): summary.txt (each step: status, seconds, limit; then the headline figures) and
# suite.tar.gz (every step's log, JSON and junit XML, and env.txt), re-packed after each step so that a call
# stopped early still returns what it did. PACK=0 writes the files into $OUT itself instead.
#
# Carried wheels in .whl/ (pytest-asyncio; fastsafetensors and runai-model-streamer for the cold-load
# comparison) are installed to /tmp/site first. Bytecode is compiled before anything runs: the image sets
# PYTHONDONTWRITEBYTECODE, so without it every daemon and engine process recompiles wcache (the GPU tests took
# 185 s instead of 109 s, and fresh engines measured the compiler).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
OUT="${OUT:-${1:-benchmarks/results/gpu-$(date +%F)}}"
PARTS="${PARTS:-restart moe loads more}"
PACK="${PACK:-1}"
SUITE_SECONDS="${SUITE_SECONDS:-570}"
declare -A SETS=(
  [restart]="tests fresh keeper imports"
  [moe]="fresh_moe"
  [loads]="cold sweep first_token tier"
  [more]="bench kills handoff fp8_writeback"
)
expanded=""
for p in $PARTS; do expanded+=" ${SETS[$p]:-$p}"; done
PARTS="$expanded"
mkdir -p "$OUT"
if [ "$PACK" = 1 ]; then RAW="${SUITE_RAW:-/tmp/wcache-suite}"; rm -rf "$RAW"; else RAW="$OUT"; fi
mkdir -p "$RAW"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if compgen -G ".whl/*.whl" >/dev/null; then
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
# bytecode for every process that follows (PYTHONDONTWRITEBYTECODE only stops writing it: .pyc files are read)
env -u PYTHONDONTWRITEBYTECODE timeout 120 python3 -m compileall -q -j 0 wcache tests benchmarks \
  $([ -d /tmp/site ] && echo /tmp/site) >/dev/null 2>&1 || echo "compileall failed (processes compile as they go)"
{
  date -u; nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,memory.used --format=csv
  timeout 60 python3 -c 'import torch, sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "python", sys.version.split()[0])'
  timeout 60 python3 -c 'import cuda.bindings, pytest, pytest_asyncio; print("cuda-bindings", cuda.bindings.__version__, "pytest", pytest.__version__, "pytest-asyncio", pytest_asyncio.__version__)'
  nproc; free -g; df -h /tmp | tail -1; echo "PARTS:$PARTS"
} > "$RAW/env.txt" 2>&1
cat "$RAW/env.txt"

status=0
SUMMARY="$OUT/summary.txt"
echo "step status seconds limit (PARTS:$PARTS)" > "$SUMMARY"
pack() {  # every file of $RAW into $OUT/suite.tar.gz (atomically), when packing
  [ "$PACK" = 1 ] || return 0
  tar czf "$OUT/.suite.tar.gz" -C "$RAW" . 2>/dev/null && mv -f "$OUT/.suite.tar.gz" "$OUT/suite.tar.gz"
}
want() { [[ " $PARTS " == *" $1 "* ]]; }
step() {  # step NAME LIMIT_S COMMAND... : log into $RAW/NAME.log, within LIMIT_S and the suite's deadline
  local name=$1 limit=$2; shift 2
  local left=$((SUITE_SECONDS - (SECONDS - START) - 15)) t0=$SECONDS rc
  if [ "$left" -lt 20 ]; then
    echo "== $name SKIPPED: ${left}s left of SUITE_SECONDS=$SUITE_SECONDS" | tee -a "$RAW/$name.log"
    echo "$name skipped 0 $limit" >> "$SUMMARY"; status=1; return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "== $name ($(date -u +%T), limit ${limit}s)" | tee "$RAW/$name.log"
  timeout "$limit" "$@" 2>&1 | tee -a "$RAW/$name.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    echo "== $name FAILED (rc $rc$([ "$rc" -eq 124 ] && echo ': timed out'))" | tee -a "$RAW/$name.log"; status=1
  fi
  echo "$name $([ "$rc" -eq 0 ] && echo ok || echo "rc=$rc") $((SECONDS - t0)) $limit" >> "$SUMMARY"
  pack
}
W=/tmp/wcache-bench
checkpoint() {  # the 16 GB Llama-3-8B-shaped checkpoint every load step uses (~25 s to generate on the H200)
  [ -f $W/llama3-8b/config.json ] || step checkpoint "${CHECKPOINT_TIMEOUT:-180}" python3 -c \
    "from wcache.synthetic import LLAMA3_8B, make_llama_checkpoint as m; from pathlib import Path; m(Path('$W/llama3-8b'), LLAMA3_8B, shards=4, seed=0, device='cuda:0')"
}
junit_json() {  # junit_json XML JSON PATTERN: the FP8 tests' results as JSON (none may skip on the H200)
  python3 - "$@" <<'PY' || status=1
import json, re, sys, xml.etree.ElementTree as ET
cases = [c for c in ET.parse(sys.argv[1]).getroot().iter("testcase") if re.search(sys.argv[3], c.get("classname", ""))]
res = {c.get("classname", "") + "::" + c.get("name", ""): next((k.tag for k in c if k.tag in ("failure", "error", "skipped")), "passed") for c in cases}
out = {"step": "fp8_checkpoint", "tests": len(res), "passed": sum(v == "passed" for v in res.values()), "results": res}
out["ok"] = out["tests"] > 0 and out["passed"] == out["tests"]
open(sys.argv[2], "w").write(json.dumps(out, indent=2) + "\n"); print(json.dumps({k: out[k] for k in ("tests", "passed", "ok")}))
sys.exit(0 if out["ok"] else 1)
PY
}
FP8_TESTS="test_fp8|test_deposit_cuda"
if want tests; then  # 39 tests: 99 s on a warm machine, over 240 s first thing on a fresh VM (2026-12-02: every
  # daemon process then reads torch from a cold disk); the FP8 ones' JSON from the same run. The two fleet-fill
  # ones (tests/gpu/test_fill_cuda.py) need NIXL: carry the nixl-cu13 wheel in .whl/, else they skip
  step gpu_tests "${TESTS_TIMEOUT:-330}" python3 -m pytest tests/gpu -q -p no:cacheprovider -o addopts="" --strict-markers -ra \
    -W default --junitxml="$RAW/gpu_tests.xml"
  [ -f "$RAW/gpu_tests.xml" ] && junit_json "$RAW/gpu_tests.xml" "$RAW/fp8_checkpoint.json" "$FP8_TESTS"
fi
if want fresh; then
  # the restart weight path in fresh engines (import -> key -> fetch -> views), 16 GB, with the anchors'
  # per-tensor IPC in the same run and the first fetch's phases (~2 min)
  checkpoint
  step fresh_engine "${FRESH_TIMEOUT:-300}" python3 benchmarks/fresh_engine_bench.py --device cuda:0 --work $W \
    --model $W/llama3-8b --copy-samples 3 --out "$RAW/fresh_engine.json" ${FRESH_ARGS:-}
fi
if want keeper; then
  # daemon SIGKILLed and restarted on its keeper: process start -> ready, no torch (~1 min)
  checkpoint
  step keeper_restart "${RESTART_TIMEOUT:-150}" python3 benchmarks/keeper_restart_bench.py --device cuda:0 --model $W/llama3-8b \
    --out "$RAW/keeper_restart.json"
fi
if want imports; then
  # what the restart path imports, and what each module costs on this machine: the least of 8 python -X importtime
  # runs per module (one run moves with the machine), the engine's import, then what a fetch loads while the daemon
  # answers: the mapping's modules (CUDA ones: CUDA is up here)
  step importtime "${IMPORTS_TIMEOUT:-90}" python3 benchmarks/import_bench.py --device cuda:0 --runs 8 \
    --out "$RAW/importtime.json"
fi
if want fresh_moe; then  # 50,000 tensors (~1.5 min)
  step fresh_engine_moe "${FRESH_MOE_TIMEOUT:-240}" python3 benchmarks/fresh_engine_bench.py --device cuda:0 --work $W \
    --moe --copy-samples 3 --named-samples 3 --out "$RAW/fresh_engine_moe.json" ${FRESH_MOE_ARGS:-}
fi
if want cold; then
  # cold loads, page cache dropped before each: wcache and fastsafetensors adjacent in both orders (wcache,
  # fastsafetensors, fastsafetensors, wcache: one call always yields the ratio, and the order's effect shows),
  # then the raw 64 MiB O_DIRECT read of the same files (the disk's ceiling) and wcache's warm load (~2 min).
  # The read-pattern variants instead: COLD_ARGS="--only wcache wcache_stream wcache_stream_512k fastsafetensors disk_direct"
  checkpoint
  step cold_load "${COLD_TIMEOUT:-240}" python3 benchmarks/cold_load_bench.py --device cuda:0 --work $W --model $W/llama3-8b \
    --out "$RAW/cold_load.json" ${COLD_ARGS:---sequence wcache fastsafetensors fastsafetensors wcache disk_direct --warm wcache}
fi
if want sweep; then
  checkpoint
  step load_sweep "${SWEEP_TIMEOUT:-200}" python3 benchmarks/load_sweep.py --device cuda:0 --model $W/llama3-8b --out "$RAW/load_sweep.json"
fi
if want first_token; then
  checkpoint
  step first_token "${FIRST_TOKEN_TIMEOUT:-180}" python3 benchmarks/first_token_bench.py --device cuda:0 --model $W/llama3-8b \
    --out "$RAW/first_token.json"
fi
if want kills; then
  step kills "${KILLS_TIMEOUT:-150}" python3 benchmarks/reliability.py --device cuda:0 --only kills --kills 100 \
    --out "$RAW/reliability_kills.json"
fi
if want tier; then
  checkpoint
  step tier_reload "${TIER_TIMEOUT:-300}" python3 benchmarks/tier_reload_bench.py --device cuda:0 --model $W/llama3-8b \
    --out "$RAW/tier_reload.json" ${TIER_ARGS:-}
fi
if want bench; then  # the all-in-one bench (~3 min; it generates its checkpoints itself)
  step gpu_bench "${BENCH_TIMEOUT:-300}" python3 benchmarks/gpu_bench.py --out "$RAW/gpu_bench.json" --work $W
  tail -n 40 $W/logs/*.log > "$RAW/daemons.log" 2>&1
fi
if want handoff; then
  checkpoint
  step handoff "${HANDOFF_TIMEOUT:-180}" python3 benchmarks/handoff_bench.py --device cuda:0 --model $W/llama3-8b \
    --out "$RAW/handoff.json"
fi
if want fp8; then
  # a block-wise FP8 checkpoint served zero_copy (bytes checked) and CUDA write-back (tests, JSON from their
  # junit: none may skip here); then fp8_writeback below
  step fp8_checkpoint "${FP8_TESTS_TIMEOUT:-200}" python3 -m pytest tests/gpu/test_fp8.py tests/gpu/test_deposit_cuda.py \
    -q -p no:cacheprovider -o addopts="" --strict-markers -ra -W default --junitxml="$RAW/fp8_tests.xml"
  [ -f "$RAW/fp8_tests.xml" ] && junit_json "$RAW/fp8_tests.xml" "$RAW/fp8_checkpoint.json" "$FP8_TESTS"
fi
if want fp8 || want fp8_writeback; then
  # transformers' FP8 quantize-on-load deposited by start 1 and mapped zero_copy by start 2, every parameter
  # bit-identical, both starts timed (~1 min)
  step fp8_writeback "${FP8_WB_TIMEOUT:-300}" python3 benchmarks/fp8_writeback_bench.py --device cuda:0 --work /tmp/wcache-fp8wb \
    --out "$RAW/fp8_writeback.json" ${FP8_WB_ARGS:-}
fi
if want disk; then
  # which read pattern the disk serves fastest cold, fastsafetensors before and after as the noise band,
  # the block queue settings and what cuFile reports (~3 min for 16 GB)
  checkpoint
  step disk_pattern "${DISK_TIMEOUT:-300}" python3 benchmarks/disk_pattern_bench.py --device cuda:0 --model $W/llama3-8b \
    --out "$RAW/disk_pattern.json" ${DISK_ARGS:-}
fi
if want driver_order; then
  # start-up order (cuda-bindings / ctypes driver calls before torch) against host-to-device copy speed
  step driver_order "${DRIVER_ORDER_TIMEOUT:-120}" python3 benchmarks/driver_order_probe.py --out "$RAW/driver_order.json"
fi
if want fleet || want fleet_host; then
  # fleet fill over NIXL (docs/fleet.md, "What is measured"), GPU first: raw NIXL READ between two processes of
  # 4 GiB VMM slabs and the dim-1 shard comparison, then the fill itself — a source daemon (--peer-listen) with
  # the 16 GB Llama, a raw READ of its slab and a fill of the same bytes (fill_over_nixl_raw), then one target
  # daemon; the same on host slabs with 1 and 2 targets; with UCX's own transport choice (one host: shared memory
  # / CUDA IPC). FLEET_TCP=1 adds the raw READ with TCP only (UCX_TLS=tcp,cuda_copy: UCX refuses tcp alone on a
  # machine with GPUs), as between hosts without RDMA. ~4 min in all, ~5 with FLEET_TCP=1. Each benchmark prints
  # one progress line per phase to stderr (the step's log shows where time went).
  if timeout 60 python3 -c 'import nixl_cu13' >/dev/null 2>&1; then
    checkpoint
    want fleet && step fleet_gpu "${FLEET_GPU_TIMEOUT:-200}" python3 benchmarks/fleet_fill_bench.py --device cuda:0 --gib 4 --chunk 64M \
      --reps 1 --fill $W/llama3-8b --targets 1 --work /tmp/wcache-fleet --out "$RAW/fleet_fill-cuda.json"
    step fleet_host "${FLEET_HOST_TIMEOUT:-180}" python3 benchmarks/fleet_fill_bench.py --device cpu --gib 4 --chunk 64M \
      --reps "${FLEET_HOST_REPS:-1}" --fill $W/llama3-8b --targets 1,2 --work /tmp/wcache-fleet --out "$RAW/fleet_fill-host.json"
    if [ "${FLEET_TCP:-0}" = 1 ]; then
      step fleet_gpu_tcp "${FLEET_TCP_TIMEOUT:-60}" env UCX_TLS=tcp,cuda_copy python3 benchmarks/fleet_fill_bench.py \
        --device cuda:0 --gib 2 --chunk 64M --reps 1 --out "$RAW/fleet_fill-cuda-tcp.json"
      step fleet_host_tcp "${FLEET_TCP_TIMEOUT:-60}" env UCX_TLS=tcp,cuda_copy python3 benchmarks/fleet_fill_bench.py \
        --device cpu --gib 2 --chunk 64M --reps 1 --out "$RAW/fleet_fill-host-tcp.json"
    fi
  else
    echo "== fleet SKIPPED: nixl_cu13 is not installed (carry its wheel in .whl/)" | tee "$RAW/fleet.log"
    echo "fleet skipped 0 0" >> "$SUMMARY"; status=1; pack
  fi
fi
python3 benchmarks/suite_summary.py "$RAW" >> "$SUMMARY" 2>&1 || true
echo "total $((SECONDS - START)) s" >> "$SUMMARY"
pack
cat "$SUMMARY"
exit $status
