#!/usr/bin/env bash
# The main job: set up .venv, make a small random checkpoint (or use --model DIR), load it with
# fastload, then serve it through vLLM's OpenAI server with --load-format fastload.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
exec python -m vllm_fastload demo "$@"
