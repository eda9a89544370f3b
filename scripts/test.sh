#!/usr/bin/env bash
# Set up .venv and run the whole test suite (vLLM integration tests included; GPU tests skip
# with their reason when there is no CUDA). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
scripts/setup-netsources.sh
python -m ruff check vllm_fastload tgi_patch tests examples
lint-imports  # the layers and forbidden imports in pyproject.toml
exec python -m pytest -rs "$@"
