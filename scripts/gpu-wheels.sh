#!/usr/bin/env bash
# Downloads into .whl/ the wheels that scripts/gpu-check.sh needs beyond what a CUDA image with
# torch already holds, for a GPU machine that has no package index. Run it on a machine that has
# one (pip and network access), then copy the repository with its .whl/ folder to the GPU machine
# and run `bash scripts/gpu-check.sh` there: it installs them into /tmp/site.
#
#   bash scripts/gpu-wheels.sh                # PYTHON=... picks the python whose pip downloads
#   bash scripts/gpu-wheels.sh --vllm         # then also the vLLM bundle for scripts/gpu-vllm.sh:
#                                             # python3 scripts/vllm_bundle.py build, which writes
#                                             # .vllm-bundle/part1 and part2 (one device call each)
#
# Target: CPython 3.12, manylinux x86_64. One version of each name: two versions of one package
# stop the whole install there. Idempotent: wheels already in .whl/ are kept, wheels of other
# versions are removed. .whl/ is added to the repository's git exclude list.
# It prints one line per wheel (name, MiB, its requirements and whether each is among the wheels
# or expected on the GPU image), the total size (kept under 50 MiB), and a PROBLEM line for a
# wheel not downloaded or a requirement found nowhere; it exits 1 if there is any.
#
# Why each one (Requires-Dist of every wheel is checked below against what is downloaded plus
# what the GPU image is expected to hold, IMAGE below):
#   kvikio-cu13, libkvikio-cu13  the kvikio backend (cuFile/GDS or its POSIX compat mode)
#   rapids-logger                libkvikio-cu13 needs librapids_logger.so
#                                (its other needs, cuda-pathfinder, cuda-toolkit[cufile], and
#                                kvikio's cupy-cuda13x>=14.0.1,!=14.1.0, numpy<3, packaging, are
#                                expected on the image)
#   fastsafetensors              comparison loader; cp312 wheel; needs only typer
#   instanttensor                comparison loader; cp312 wheel, and its extension links no libtorch
#                                (only libc/libstdc++), so it fits torch 2.11; needs torch>=2.8
#   pydantic & co                vllm_fastload.config needs pydantic 2.
#                                torch 2.11 asks typing-extensions>=4.10, pydantic 2.14 >=4.14.1
#   pydantic-settings, dotenv    vllm_fastload.config reads FASTLOAD_* through pydantic-settings
#   pytest & co, hypothesis      pinned, so that the tests run with the versions they are written
#                                for (gpu-check.sh loads only the pytest plugins it names)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_BUNDLE=0
for arg in "$@"; do
  case "$arg" in
    --vllm) VLLM_BUNDLE=1 ;;
    *) echo "unknown argument: $arg (only --vllm)" >&2; exit 2 ;;
  esac
done
LIMIT_MIB=50
PINS=(
  kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 rapids-logger==0.3.0
  fastsafetensors==0.5.0 instanttensor==0.2.2
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0 pydantic-settings==2.16.3 python-dotenv==1.2.4
  pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.3 pytest-timeout==2.4.0
  hypothesis==6.170.15 sortedcontainers==2.4.0 attrs==26.1.0
)
# Expected on the GPU image already (a CUDA image with torch 2.11 and CUDA 13); not downloaded.
IMAGE="torch numpy safetensors tqdm cupy-cuda13x cuda-pathfinder cuda-toolkit nvidia-cufile cuda-bindings
cuda-core typer pygments filelock jinja2 fsspec networkx sympy setuptools triton"

mkdir -p .whl
if ! git check-ignore -q .whl/x.whl 2>/dev/null; then
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  echo "/.whl/" >> "$exclude"
  echo "added /.whl/ to $exclude"
fi

"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${PINS[@]}" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)

status=0
PINS="${PINS[*]}" IMAGE="$IMAGE" LIMIT_MIB=$LIMIT_MIB "$PY" - <<'EOF' || status=$?
import os, re, sys, zipfile
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

#: The GPU machine, for evaluating Requires-Dist markers (extras are not installed).
TARGET = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
          "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython",
          "platform_release": "", "platform_version": "", "implementation_version": "3.12.3", "extra": ""}


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

pins = dict(p.split("==") for p in os.environ["PINS"].split())
pins = {norm(k): v for k, v in pins.items()}
image = {norm(n) for n in os.environ["IMAGE"].split()}
kept, problems = {}, []
for whl in sorted(Path(".whl").glob("*.whl")):
    name, version = whl.name.split("-")[:2]
    if pins.get(norm(name)) != version:
        print(f"removing {whl.name} (not pinned)")
        whl.unlink()
        continue
    kept[norm(name)] = whl
missing = sorted(set(pins) - set(kept))
if missing:
    problems.append(f"not downloaded: {', '.join(missing)}")
total = 0
print(f"{'wheel':<84} {'MiB':>6}  needs (not extras)")
for name, whl in sorted(kept.items()):
    size = whl.stat().st_size
    total += size
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    needs = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate(TARGET):
            continue  # an extra, or another platform or Python
        dep = norm(req.name)
        where = "carried" if dep in kept else "image" if dep in image else "MISSING"
        needs.append(f"{req} [{where}]")
        if where == "MISSING":
            problems.append(f"{whl.name} needs {req}: neither carried nor in the image")
    print(f"{whl.name:<84} {size / 2**20:6.2f}  {'; '.join(needs) or '-'}")
print(f"{len(kept)} wheels, {total / 2**20:.1f} MiB in .whl/ (limit {os.environ['LIMIT_MIB']} MiB; a device call "
      "carries 64 MiB at most)")
if total > int(os.environ["LIMIT_MIB"]) * 2**20:
    problems.append("over the size limit")
for p in problems:
    print("PROBLEM:", p)
sys.exit(1 if problems else 0)
EOF
if [ "$VLLM_BUNDLE" = 1 ]; then
  if [ "$status" != 0 ]; then echo "no vLLM bundle built: the wheels above have problems"; exit "$status"; fi
  "$PY" scripts/vllm_bundle.py build
  exit $?
fi
exit "$status"
