#!/usr/bin/env bash
# The whole GPU check of vllm-fastload on one CUDA machine: tests, then the GPU benchmark.
#
#   bash scripts/gpu-check.sh                 # from anywhere; it works in the repository root
#
# It uses the python3 on PATH, which needs a CUDA build of torch, this package's dependencies
# (pydantic, pydantic-settings, numpy, safetensors, tqdm), pytest, pytest-timeout and hypothesis,
# and, for the comparisons, kvikio, fastsafetensors and instanttensor. Install them into that
# environment, or, on a GPU machine without a package index, run scripts/gpu-wheels.sh on a
# machine with one and copy the resulting .whl/ folder into the repository here first.
#
# What it does, and prints:
#   1. the machine: GPU, driver, PCIe link, CPUs, memory, the disks, and whether the GDS kernel
#      driver (nvidia-fs) is loaded;
#   2. where .whl/ exists, installs those wheels into /tmp/site (PYTHONPATH=/tmp/site:$PWD); then
#      the Python, torch and CUDA versions, which packages import, and the GDS status;
#   3. the GPU tests with pytest -rs: tests/core/test_gpu.py (every reader test that takes a
#      CUDA device: cuda, kvikio and auto backends) and tests/core/test_bench_gpu.py (the
#      benchmark's smoke form); GPU_CHECK_CORE=1 runs all of tests/core instead;
#   4. `vllm-fastload bench-gpu` (as `python3 -m vllm_fastload bench-gpu`): a 5.6 GB checkpoint
#      of 8 Llama-3-8B layers on a local disk (never tmpfs), loaders interleaved, 3 repetitions,
#      cold and warm, against the disk, page-cache and host-to-device limits, with its table and
#      target verdicts;
#   and a last line saying whether the tests passed and the benchmark ran (exit status 0 if both).
# Everything printed goes to $OUT/gpu-check.log too; the JSON to $OUT/bench-gpu.json, test
# results to $OUT/pytest-gpu.xml (bench-results/ where $OUT is unset). It stays inside
# GPU_CHECK_BUDGET seconds (default 500): the tests get at most GPU_CHECK_TESTS_S (default 200),
# the benchmark the rest, and it stops starting repetitions in time.
# Other knobs: GPU_CHECK_DIR (checkpoint directory), GPU_CHECK_LAYERS (8), GPU_CHECK_REPEATS (3),
# and the usual FASTLOAD_* variables (e.g. FASTLOAD_MEMORY_BUDGET) for fastload's configuration.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/gpu-env.sh
OUT_DIR=${OUT:-bench-results}
mkdir -p "$OUT_DIR"
START=$SECONDS
BUDGET=${GPU_CHECK_BUDGET:-500}

main() {
  local status=0 bench_status=0
  gpu_machine

  echo "== wheels"
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl 2>&1 | grep -v "Running pip as the 'root' user"
    if [ "${PIPESTATUS[0]}" != 0 ]; then echo "WHEEL INSTALL FAILED: the steps below run without them"; fi
    echo "installed $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
    export PYTHONPATH=/tmp/site:$PWD
  else
    echo "WARNING: no .whl/ folder: run scripts/gpu-wheels.sh before the call and carry .whl"
    export PYTHONPATH=$PWD
  fi
  gpu_libpath  # scripts/gpu-env.sh
  python3 - <<'EOF'
import importlib, sys
import torch
print(f"python {sys.version.split()[0]} ({sys.executable}); torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"cuda available: {torch.cuda.is_available()}")
for name in ("vllm_fastload", "pydantic", "safetensors", "numpy", "cupy", "kvikio", "fastsafetensors",
             "instanttensor", "pytest", "hypothesis"):
    try:
        module = importlib.import_module(name)
        print(f"  {name} {getattr(module, '__version__', '')} ({module.__file__})")
    except Exception as exc:
        print(f"  {name}: NOT importable: {type(exc).__name__}: {exc}")
try:
    from vllm_fastload.readers.kvikio import gds_status
    print(f"  GDS: {gds_status()}")
except Exception as exc:
    print(f"  GDS status failed: {type(exc).__name__}: {exc}")
EOF

  echo "== GPU tests ($((SECONDS - START)) s so far)"
  local tests=(tests/core/test_gpu.py tests/core/test_bench_gpu.py)
  if [ "${GPU_CHECK_CORE:-0}" = 1 ]; then tests=(tests/core); fi
  # Only the plugins named here: the image's own pytest plugins must not meet the carried pytest.
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTHONUNBUFFERED=1 timeout -k 10 "${GPU_CHECK_TESTS_S:-200}" \
    python3 -m pytest -rs -q -p pytest_timeout -p _hypothesis_pytestplugin -p no:cacheprovider --timeout 150 \
    --junitxml "$OUT_DIR/pytest-gpu.xml" "${tests[@]}" || status=$?
  echo "pytest exit status: $status"

  local dir left
  dir=$(pick_local_dir bench-gpu "${GPU_CHECK_DIR:-}")
  left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 120 ]; then left=120; fi  # `timeout 0` would mean no limit at all
  echo "== bench-gpu ($((SECONDS - START)) s so far, $left s left); checkpoint in $dir ($(fstype "$dir"))"
  df -h "$dir" | tail -1
  PYTHONUNBUFFERED=1 timeout -k 10 "$left" python3 -m vllm_fastload bench-gpu --out "$OUT_DIR" --dir "$dir" \
    --layers "${GPU_CHECK_LAYERS:-8}" --repeats "${GPU_CHECK_REPEATS:-3}" --time-limit $((left - 60)) \
    || bench_status=$?
  echo "bench-gpu exit status: $bench_status"
  echo "== done in $((SECONDS - START)) s: tests $([ $status = 0 ] && echo passed || echo "FAILED ($status)"), bench $(
    [ $bench_status = 0 ] && echo ok || echo "FAILED ($bench_status)")"
  [ $status = 0 ] && [ $bench_status = 0 ]
}

main "$@" 2>&1 | tee "$OUT_DIR/gpu-check.log"
exit "${PIPESTATUS[0]}"
