"""vLLM 0.26 for a GPU machine without a package index, in two device transfers.

The GPU machine's image holds Python 3.12, torch 2.11 (CUDA 13), transformers, triton and more,
but no vLLM and nothing can be fetched there; a device command takes 64 MiB of files. vLLM 0.26.0
(the release built for torch 2.11) is a 289 MB wheel. This script builds, on a machine with a
package index, one archive of what ``LLM(...)`` and vLLM's model loaders need there, trimmed and
xz-compressed, split into parts that each fit one transfer:

* vLLM 0.26.0's files, less what a Hopper GPU loading and running a dense model never imports:
  the FlashAttention-2 kernels (``_vllm_fa2_C``, 305 MB: on SM 9.x vLLM picks FlashAttention 3,
  whose kernels are kept; they compress to 8 MB), the fused-MoE kernels (``_moe_C_stable_libtorch``,
  40 MB compressed; vLLM imports them only if present, and a MoE model's *forward* needs them,
  its loading does not), the ``vllm-rs`` front-end binary (``LLM(...)`` does not start it),
  DeepGEMM (block-quantized fp8 only) and the SM100 attention kernels (Blackwell only);
* the pure-Python and small compiled packages ``LLM(...)`` imports that the image lacks
  (``DEPS``; each one's requirements are checked against the image's package list);
* the wheels ``scripts/gpu-wheels.sh`` downloads that the vLLM run uses (``PROJECT``: pydantic for
  fastload's config, kvikio, fastsafetensors, instanttensor), unpacked too.

Everything is unpacked into one folder (``/tmp/vsite`` on the GPU machine) that goes first on
``PYTHONPATH``; nothing is installed with pip there.

Commands (stdlib only; ``build`` needs pip and network access):

  python3 scripts/vllm_bundle.py build          # -> .vllm-bundle/part1/, .vllm-bundle/part2/ (+ downloads/)
  python3 scripts/vllm_bundle.py stage DIR      # copy the parts found in the repository to DIR
  python3 scripts/vllm_bundle.py unpack DIR SITE  # DIR holds every part: check, unpack into SITE
  python3 scripts/vllm_bundle.py imports        # with SITE and the repository on PYTHONPATH: import check
  python3 scripts/vllm_bundle.py check PYTHON [--engine]
      # build's parts unpacked as on the GPU machine and imported by PYTHON (a Python 3.12 with
      # torch 2.11's CUDA build and the image's packages); --engine: then vLLM 0.26's loaders run
      # on a CPU stand-in platform (verify and the GPU run's loads step on small checkpoints)

The staging on the GPU machine (two device calls on the same warm machine, the second within its
warm time, 30 s, of the first; ``scripts/gpu-vllm.sh`` calls ``stage``, ``unpack`` and ``imports``):

  call 1: carry [".vllm-bundle/part1"], timeout_s 120, command: bash scripts/gpu-vllm.sh --stage
  call 2: carry [".vllm-bundle/part2"], timeout_s 600, command: bash scripts/gpu-vllm.sh "$OUT"
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import io
import json
import lzma
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / ".vllm-bundle"
VLLM = "vllm==0.26.0"
#: The test-only platform plugin that runs a vLLM GPU build as vLLM's CPU platform (its docstring
#: says what it changes), for ``check --engine``.
STANDIN = "tests/vllm/gpu_build_on_cpu"
#: The wheel's files left out (fnmatch-style globs on paths inside the wheel), and why.
LEFT_OUT = {
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "FlashAttention 2: vLLM uses FlashAttention 3 on SM 9.x",
    "vllm/_moe_C_stable_libtorch.abi3.so": "fused-MoE kernels: a MoE forward needs them, loading does not",
    "vllm/vllm-rs": "the Rust front end: LLM(...) does not start it",
    "vllm/third_party/deep_gemm/*": "DeepGEMM: block-quantized fp8 only",
    "vllm/third_party/fmha_sm100/*": "SM100 attention kernels: Blackwell only",
}
#: What LLM(...), vLLM's loaders and compressed-tensors checkpoints import that the image lacks,
#: with their own requirements missing from the image. Found by ``check`` (every module of
#: ``MODULES`` imports) and by reading where vLLM imports lazily on the way to a generation
#: (blake3: hashes; setproctitle: its processes' titles; depyf, astor, dill: torch.compile's
#: wrapper). Versions: the ones vLLM 0.26.0 asks for, else the newest that fits Python 3.12 and
#: the image. vLLM imports xgrammar and llguidance when it starts (class annotations of its
#: structured-output backends); it asks for llguidance >= 1.7, which the index does not serve:
#: 1.6.1 imports, and only guided decoding, which this run does not use, would call it.
DEPS = [
    "blake3==1.0.11", "cachetools==8.0.2", "cbor2==6.3.0", "msgspec==0.22.0", "pyzmq==27.3.0",
    "openai==2.54.0", "jiter==0.19.0", "distro==1.9.0", "sniffio==1.3.1", "openai-harmony==0.0.8",
    "fastapi==0.136.3", "starlette==1.10.0", "compressed-tensors==0.17.0", "loguru==0.7.3",
    "partial-json-parser==0.2.1.1.post7", "pybase64==1.5.1", "setproctitle==1.3.8", "python-json-logger==4.2.0",
    "depyf==0.20.0", "astor==0.8.1", "dill==0.4.1",
    "xgrammar==0.2.7", "apache-tvm-ffi==0.1.10", "llguidance==1.6.1",
]
#: Of the wheels ``scripts/gpu-wheels.sh`` keeps in .whl/, those the vLLM run needs (by name).
PROJECT = ["pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
           "pydantic-settings", "python-dotenv", "kvikio-cu13", "libkvikio-cu13", "rapids-logger",
           "fastsafetensors", "instanttensor"]
#: The most bytes of one part: a device call carries 64 MiB with the working tree.
PART_BYTES = 58 << 20
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_5_x86_64", "manylinux1_x86_64"]
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
          *[a for p in PLATFORMS for a in ("--platform", p)]]
MANIFEST = "MANIFEST.json"


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_name(path: Path) -> str:
    return norm(path.name.split("-")[0])


# -- build ---------------------------------------------------------------------------------------
def build(args: argparse.Namespace) -> int:
    downloads = BUNDLE / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    _pip("download", "-q", "--no-deps", *TARGET, "-d", str(downloads), VLLM, *DEPS)
    wanted = {norm(p.split("==")[0]): p.split("==")[1] for p in [VLLM, *DEPS]}
    wheels = {}
    for whl in sorted(downloads.glob("*.whl")):
        name, version = wheel_name(whl), whl.name.split("-")[1]
        if wanted.get(name) == version:
            wheels[name] = whl
    missing = sorted(set(wanted) - set(wheels))
    if missing:
        raise SystemExit(f"not downloaded: {', '.join(missing)}")
    project = {wheel_name(w): w for w in (ROOT / ".whl").glob("*.whl") if wheel_name(w) in {norm(p) for p in PROJECT}}
    if len(project) != len(PROJECT):
        raise SystemExit(f"run scripts/gpu-wheels.sh first: .whl/ lacks "
                         f"{', '.join(sorted({norm(p) for p in PROJECT} - set(project)))}")
    stage = BUNDLE / "stage"
    shutil.rmtree(stage, ignore_errors=True)
    site = stage / "site"
    site.mkdir(parents=True)
    others = [str(w) for n, w in sorted(wheels.items()) if n != "vllm"] + [str(w) for w in project.values()]
    _pip("install", "-q", "--no-deps", "--no-index", "--no-compile", "--target", str(site), *TARGET, *others)
    left_out = _unpack_vllm(wheels["vllm"], site)
    problems = _requirements(list(wheels.values()) + list(project.values()))
    archive = stage / "vllm-bundle.tar.xz"
    start = time.time()
    with lzma.open(archive, "wb", preset=9 | lzma.PRESET_EXTREME) as raw, \
            tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(site.rglob("*")):
            if "__pycache__" in path.parts:
                continue
            tar.add(path, arcname=str(path.relative_to(site)), recursive=False)
    print(f"compressed {sum(f.stat().st_size for f in site.rglob('*') if f.is_file()) / 2**20:.0f} MiB into "
          f"{archive.stat().st_size / 2**20:.1f} MiB in {time.time() - start:.0f} s")
    _split(archive, wheels, project, left_out)
    shutil.rmtree(stage)  # the unpacked files (350 MB); downloads/ stays, for the next build
    for p in problems:
        print("PROBLEM:", p)
    return 1 if problems else 0


def _pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    noise = ("is ignored: it is neither a file nor a directory", "Running pip as the 'root' user")
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.strip() and not any(n in line for n in noise):
            print(line)
    if proc.returncode:
        raise SystemExit(f"pip {args[0]} failed ({proc.returncode})")


def _unpack_vllm(wheel: Path, site: Path) -> dict[str, int]:
    """vLLM's wheel into ``site`` less ``LEFT_OUT``; returns bytes left out per pattern."""
    import fnmatch

    left: dict[str, int] = dict.fromkeys(LEFT_OUT, 0)
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            hit = next((p for p in LEFT_OUT if fnmatch.fnmatch(info.filename, p)), None)
            if hit:
                left[hit] += info.file_size
                continue
            target = site / info.filename
            if info.is_dir():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(info) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            mode = info.external_attr >> 16
            if mode & 0o111:
                target.chmod(0o755)
    for pattern, n in left.items():
        print(f"left out {pattern}: {n / 2**20:.0f} MiB ({LEFT_OUT[pattern]})")
    return left


def _image_packages() -> set[str]:
    """The GPU image's package names, from the device notes' list (or IMAGE_PACKAGES, comma-separated)."""
    listed = os.environ.get("IMAGE_PACKAGES")
    if listed:
        return {norm(n) for n in listed.split(",") if n.strip()}
    kinds = Path("/work/.library/device/KINDS.md")
    text = kinds.read_text() if kinds.exists() else ""
    match = re.search(r"Packages: (.+?)\.\s*$", text, re.M)
    if not match:
        raise SystemExit("cannot read the GPU image's package list: set IMAGE_PACKAGES=name,name,...")
    return {norm(n) for n in match.group(1).split(", ")}


def _requirements(wheels: list[Path]) -> list[str]:
    """Each carried wheel's requirements that neither the image nor the bundle satisfies by name
    (extras and other platforms' markers are not requirements here). vLLM's own list is checked
    by ``check``, by importing: most of it is for the API server, not for ``LLM(...)``."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        from pip._vendor.packaging.requirements import Requirement
    env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython",
           "platform_release": "", "platform_version": "", "implementation_version": "3.12.3", "extra": ""}
    image = _image_packages()
    carried = {wheel_name(w) for w in wheels}
    problems = []
    for whl in wheels:
        if wheel_name(whl) == "vllm":
            continue
        with zipfile.ZipFile(whl) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            for line in z.read(meta).decode().splitlines():
                if not line.startswith("Requires-Dist:"):
                    continue
                req = Requirement(line.split(":", 1)[1].strip())
                if req.marker is not None and not req.marker.evaluate(env):
                    continue
                if norm(req.name) not in image | carried:
                    problems.append(f"{whl.name} needs {req}: neither carried nor in the image")
    return problems


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _split(archive: Path, wheels: dict[str, Path], project: dict[str, Path], left_out: dict[str, int]) -> None:
    """``archive`` cut into ``.vllm-bundle/partN/bundle.partN`` files of at most ``PART_BYTES``,
    each folder with the manifest (what the whole is, and every part's digest)."""
    for old in BUNDLE.glob("part*"):
        shutil.rmtree(old)
    size = archive.stat().st_size
    count = -(-size // PART_BYTES)
    parts = []
    with open(archive, "rb") as f:
        for k in range(1, count + 1):
            folder = BUNDLE / f"part{k}"
            folder.mkdir(parents=True)
            path = folder / f"bundle.part{k}"
            path.write_bytes(f.read(PART_BYTES))
            parts.append({"name": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)})
    manifest = {"bundle": "vllm-0.26.0 for Python 3.12, torch 2.11 (CUDA 13), x86_64", "sha256": _sha256(archive),
                "bytes": size, "parts": parts,
                "wheels": sorted(w.name for w in [*wheels.values(), *project.values()]),
                "left_out": {p: {"bytes": n, "why": LEFT_OUT[p]} for p, n in left_out.items()}}
    for k in range(1, count + 1):
        (BUNDLE / f"part{k}" / MANIFEST).write_text(json.dumps(manifest, indent=1))
    archive.unlink()
    for part in parts:
        print(f"{part['name']}: {part['bytes'] / 2**20:.1f} MiB")
    print(f"{count} parts, {size / 2**20:.1f} MiB in all, in {BUNDLE}/part*/ (a device call carries one part)")


# -- on the GPU machine ---------------------------------------------------------------------------
def stage(args: argparse.Namespace) -> int:
    """Copy the parts this call carried (``.vllm-bundle/part*``) into ``DIR``, which outlives the call."""
    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    found = []
    for folder in sorted(BUNDLE.glob("part*")):
        for f in folder.iterdir():
            if f.name.startswith("bundle.part") or f.name == MANIFEST:
                shutil.copyfile(f, out / f.name)
                if f.name != MANIFEST:
                    found.append(f.name)
    print(f"staged {', '.join(found) or 'no part (none carried)'} in {out}")
    return 0


class _Parts(io.RawIOBase):
    """The parts read back to back as one stream."""

    def __init__(self, paths: list[Path]) -> None:
        self._paths = list(paths)
        self._file: io.BufferedReader | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._file is not None or self._paths:
            if self._file is None:
                self._file = self._paths.pop(0).open("rb")
            n = self._file.readinto(buffer)
            if n:
                return n
            self._file.close()
            self._file = None
        return 0

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        super().close()


def unpack(args: argparse.Namespace) -> int:
    """Check the parts in ``DIR`` against their manifest and unpack them into ``SITE`` (once: a
    stamp with the bundle's digest makes a second call a no-op)."""
    folder, site = Path(args.dir), Path(args.site)
    manifest_path = folder / MANIFEST
    if not manifest_path.exists():
        print(f"no bundle staged in {folder}: run call 1 (bash scripts/gpu-vllm.sh --stage, carrying "
              ".vllm-bundle/part1) on this machine first", file=sys.stderr)
        return 3
    manifest = json.loads(manifest_path.read_text())
    stamp = site / ".vllm-bundle.sha256"
    if stamp.exists() and stamp.read_text() == manifest["sha256"]:
        print(f"{site}: bundle already unpacked")
        return 0
    missing = [p["name"] for p in manifest["parts"] if not (folder / p["name"]).exists()]
    if missing:
        print(f"bundle parts missing from {folder}: {', '.join(missing)}; each device call carries one part "
              "(call 1: .vllm-bundle/part1, call 2: .vllm-bundle/part2) and both must reach the same machine "
              "(the second call within the warm time of the first); run call 1 again, then call 2",
              file=sys.stderr)
        return 3
    bad = [p["name"] for p in manifest["parts"] if _sha256(folder / p["name"]) != p["sha256"]]
    if bad:
        print(f"bundle parts damaged or from another build: {', '.join(bad)}", file=sys.stderr)
        return 3
    start = time.time()
    tmp = site.with_name(site.name + ".new")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    stream = io.BufferedReader(_Parts([folder / p["name"] for p in manifest["parts"]]), 1 << 20)
    with lzma.open(stream, "rb") as raw, tarfile.open(fileobj=raw, mode="r|") as tar:
        tar.extractall(tmp, filter="data")
    _write_fastload_dist_info(tmp)
    shutil.rmtree(site, ignore_errors=True)
    tmp.rename(site)
    stamp.write_text(manifest["sha256"])
    files = sum(1 for _ in site.rglob("*"))
    print(f"unpacked the bundle ({manifest['bytes'] / 2**20:.1f} MiB, {len(manifest['parts'])} parts) into {site}: "
          f"{files} files in {time.time() - start:.1f} s")
    return 0


def _write_fastload_dist_info(site: Path) -> None:
    """vLLM finds plugins through entry points (``vllm.general_plugins``), which need package
    metadata: the repository is on ``PYTHONPATH``, not installed, so its entry points are
    written here, from pyproject.toml."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    version = project.get("version", "0")
    info = site / f"vllm_fastload-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm-fastload\nVersion: {version}\n")
    lines = []
    for group, entries in project.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{k} = {v}" for k, v in entries.items()]
    if project.get("scripts"):
        lines.append("[console_scripts]")
        lines += [f"{k} = {v}" for k, v in project["scripts"].items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    (info / "top_level.txt").write_text("vllm_fastload\n")


# -- the import check ------------------------------------------------------------------------------
#: What the vLLM run imports, in the order it does (vLLM's GPU worker and attention backends load
#: on CUDA only; importing them here proves their imports resolve).
MODULES = [
    "torch", "vllm", "vllm.platforms.cuda", "vllm.engine.arg_utils", "vllm.entrypoints.llm",
    "vllm.model_executor.model_loader", "vllm.model_executor.model_loader.default_loader",
    "vllm.model_executor.model_loader.weight_utils", "vllm.model_executor.models.llama",
    "vllm.model_executor.models.mixtral",
    "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors",
    "vllm.model_executor.layers.fused_moe", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine",
    "vllm.v1.executor.uniproc_executor", "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu_model_runner", "vllm.v1.attention.backends.triton_attn",
    "vllm.v1.attention.backends.flash_attn", "vllm.vllm_flash_attn", "vllm.distributed.parallel_state",
    "vllm.distributed.device_communicators.pynccl", "vllm.v1.sample.sampler",
    "vllm_fastload", "vllm_fastload.vllm_plugin.loader", "vllm_fastload.tools.verify",
    "vllm_fastload.bench.gpu_vllm", "fastsafetensors", "instanttensor", "kvikio",
]
#: Kernels of vLLM's libraries the run calls on a GPU (norms, activations, rotary embeddings, the
#: KV cache, fp8 matmuls, FlashAttention 3), registered with torch when the libraries load.
OPS = [("_C", "rms_norm"), ("_C", "silu_and_mul"), ("_C", "rotary_embedding"),
       ("_C_cache_ops", "reshape_and_cache_flash"), ("_C", "cutlass_scaled_mm"), ("_vllm_fa3_C", "fwd")]
#: Modules that import only where a GPU and its driver are (checked on the GPU machine; on a
#: machine without one their failure is printed and not counted).
NEEDS_DRIVER = {"vllm.platforms.cuda", "vllm.vllm_flash_attn", "vllm.v1.attention.backends.flash_attn",
                "fastsafetensors", "instanttensor", "kvikio"}


def imports(args: argparse.Namespace) -> int:
    """Import every module of ``MODULES`` in this Python; register fastload as vLLM does."""
    import traceback

    gpu = _has_driver()
    failed = []
    for name in MODULES:
        start = time.time()
        try:
            importlib.import_module(name)
            print(f"  ok   {name} ({time.time() - start:.1f} s)")
        except Exception as exc:  # ImportError, or a library failing to load its native part
            line = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            if name in NEEDS_DRIVER and not gpu:
                print(f"  --   {name}: {line} (needs a GPU driver: not counted on this machine)")
                continue
            print(f"  FAIL {name}: {line}")
            if args.verbose:
                traceback.print_exc()
            failed.append(name)
    if "vllm.platforms.cuda" in sys.modules:
        import torch

        missing = []
        for namespace, op in OPS:
            try:
                getattr(getattr(torch.ops, namespace), op)
            except (AttributeError, RuntimeError):
                missing.append(f"torch.ops.{namespace}.{op}")
        for op in missing:
            print(f"  FAIL {op}: not registered by vLLM's kernel libraries")
        if not missing:
            print(f"  ok   vLLM's kernels registered with torch: {', '.join(f'{n}.{o}' for n, o in OPS)}")
        failed += missing
    if "vllm.vllm_flash_attn" in sys.modules:
        from vllm.vllm_flash_attn import flash_attn_interface as fa

        print(f"  FlashAttention 3 available: {fa.FA3_AVAILABLE}; FlashAttention 2: {fa.FA2_AVAILABLE} (left out)")
        if not fa.FA3_AVAILABLE:
            failed.append("FlashAttention 3")
    try:
        from vllm.model_executor import model_loader
        from vllm.plugins import load_general_plugins

        from vllm_fastload.vllm_plugin import compat

        load_general_plugins()
        registered = "fastload" in model_loader._LOAD_FORMAT_TO_MODEL_LOADER
        version = compat.vllm_version()
        print(f"  vLLM {version}: fastload {'registered' if registered else 'NOT registered'} through the "
              f"vllm.general_plugins entry point; interfaces missing: {compat.missing_interfaces() or 'none'}; "
              f"in the tested range: {compat.is_supported(version)}")
        formats = sorted(model_loader._LOAD_FORMAT_TO_MODEL_LOADER)
        print(f"  load formats: {', '.join(formats)}")
        if not registered:
            failed.append("fastload registration")
        for needed in ("fastsafetensors", "instanttensor", "safetensors", "auto"):
            if needed not in formats:
                failed.append(f"load format {needed}")
    except Exception as exc:
        print(f"  FAIL plugin registration: {type(exc).__name__}: {exc}")
        failed.append("plugin registration")
    print(f"import check: {len(failed)} failed{': ' + ', '.join(failed) if failed else ''} "
          f"({'with' if gpu else 'without'} a libcuda.so.1)")
    return 1 if failed else 0


def _has_driver() -> bool:
    """Whether a libcuda.so.1 loads: the GPU driver's, or ``check``'s stand-in."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def check(args: argparse.Namespace) -> int:
    """The built parts unpacked exactly as on the GPU machine (stage, then unpack into a fresh
    folder), then ``imports`` run by ``PYTHON`` (an environment like the GPU image: Python 3.12,
    torch 2.11's CUDA build, which imports without a GPU) with that folder and the repository on
    ``PYTHONPATH``, as scripts/gpu-vllm.sh sets them. ``--engine``: then vLLM 0.26's loaders on the
    CPU stand-in (``STANDIN``): ``vllm-fastload verify`` on a small Llama, Mixtral and fp8 Llama,
    and the GPU run's ``loads`` step on a small Llama."""
    with tempfile.TemporaryDirectory(prefix="vllm-bundle-check-") as tmp:
        staged, site = Path(tmp, "staged"), Path(tmp, "vsite")
        stage(argparse.Namespace(dir=str(staged)))
        code = unpack(argparse.Namespace(dir=str(staged), site=str(site)))
        if code:
            return code
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "PYTHONNOUSERSITE": "1"}
        stub = _stub_driver(Path(tmp), site)
        if stub is not None:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(stub), os.environ.get("LD_LIBRARY_PATH")]))
            print(f"a stub libcuda.so.1 ({stub}) stands in for the GPU driver: vLLM's kernel libraries load and "
                  "register their ops; nothing calls the driver")
        python = os.path.abspath(args.python) if os.sep in args.python else args.python
        cmd = [python, str(Path(__file__).resolve()), "imports"] + (["--verbose"] if args.verbose else [])
        code = subprocess.run(cmd, env=env, cwd=tmp).returncode
        if code or not args.engine:
            return code
        return _engine_check(python, Path(tmp), site)


def _stub_driver(tmp: Path, site: Path) -> Path | None:
    """A libcuda.so.1 defining the driver functions vLLM's kernel libraries link to, each failing
    with CUDA_ERROR_NO_DEVICE: with it, a machine without a GPU loads those libraries (their
    torch ops register at load), so that their other links and torch's symbols are checked too.
    None without a C compiler or ``nm``."""
    compiler, nm = shutil.which("cc") or shutil.which("gcc"), shutil.which("nm")
    if compiler is None or nm is None:
        return None
    names: set[str] = set()
    for lib in site.glob("vllm/**/*.so"):
        out = subprocess.run([nm, "-D", "--undefined-only", str(lib)], capture_output=True, text=True).stdout
        names.update(p.split()[-1] for p in out.splitlines() if re.match(r"^\s*U cu[A-Z]", p))
    folder = tmp / "stub-driver"
    folder.mkdir()
    (folder / "cuda.c").write_text("".join(f"int {n}(void) {{ return 100; }}\n" for n in sorted(names)))
    built = subprocess.run([compiler, "-shared", "-fPIC", "-o", str(folder / "libcuda.so.1"), str(folder / "cuda.c")],
                           capture_output=True, text=True)
    return folder if built.returncode == 0 else None


_CHECKPOINTS = '''
import sys
from vllm_fastload.tools.checkpoints import ModelSpec, write_checkpoint
from vllm_fastload.tools.quantize import quantize_checkpoint
root = sys.argv[1]
write_checkpoint(f"{root}/llama", "tiny-llama", files=2)
write_checkpoint(f"{root}/mixtral", "tiny-mixtral", files=2)
write_checkpoint(f"{root}/warmup", ModelSpec(hidden=128, intermediate=256, layers=1, heads=2, kv_heads=1, vocab=256))
quantize_checkpoint(f"{root}/llama", f"{root}/llama-fp8", "fp8")
'''


def _engine_check(python: str, tmp: Path, site: Path) -> int:
    standin = ROOT / STANDIN
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(standin), str(site), str(ROOT)]),
           "PYTHONNOUSERSITE": "1", "HF_HUB_OFFLINE": "1", "FASTLOAD_PROGRESS": "false",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    ck = tmp / "checkpoints"
    subprocess.run([python, "-c", _CHECKPOINTS, str(ck)], env=env, cwd=tmp, check=True)
    print("== vllm-fastload verify on vLLM 0.26 (CPU stand-in): a Llama, a Mixtral, an fp8 Llama", flush=True)
    verify = subprocess.run([python, "-m", "vllm_fastload", "verify", str(ck / "llama"), str(ck / "mixtral"),
                             str(ck / "llama-fp8")], env=env, cwd=tmp).returncode
    print("== the GPU run's loads step on vLLM 0.26 (CPU stand-in): fastload, safetensors, safetensors-prefetch",
          flush=True)
    spec = {"device": "cpu", "model": str(ck / "llama"), "warmup": str(ck / "warmup"), "repeats": 1,
            "deadline_s": 300, "out": str(tmp / "loads.json"),
            "loaders": ["fastload", "safetensors", "safetensors-prefetch"]}
    loads = subprocess.run([python, "-m", "vllm_fastload.bench.gpu_vllm", "loads", json.dumps(spec)], env=env,
                           cwd=tmp).returncode
    records = json.loads((tmp / "loads.json").read_text())["records"] if (tmp / "loads.json").exists() else []
    failed = [r for r in records if "error" in r]
    print(f"engine check: verify exit {verify}; loads exit {loads}, {len(records)} loads, {len(failed)} failed")
    return 1 if verify or loads or failed or len(records) != 6 else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build").set_defaults(func=build)
    p = sub.add_parser("stage")
    p.add_argument("dir")
    p.set_defaults(func=stage)
    p = sub.add_parser("unpack")
    p.add_argument("dir")
    p.add_argument("site")
    p.set_defaults(func=unpack)
    p = sub.add_parser("imports")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=imports)
    p = sub.add_parser("check")
    p.add_argument("python", help="a Python 3.12 with torch 2.11 (CUDA build) and the image's other packages")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--engine", action="store_true", help="then vLLM 0.26's loaders on a CPU stand-in platform")
    p.set_defaults(func=check)
    args = parser.parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
