#!/usr/bin/env bash
# The main job: set up .venv, write a 1.67 GB random Llama checkpoint once (or use --model DIR),
# then serve it through vLLM's OpenAI server with --load-format fastload and with vLLM's default
# loader, each started cold, and print what each took side by side (vllm_fastload/bench/demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup.sh
exec python -m vllm_fastload demo "$@"
