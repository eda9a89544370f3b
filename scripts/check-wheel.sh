#!/usr/bin/env bash
# The package as users get it: builds the wheel (python -m build) and installs it, not the
# checkout, into an environment that holds vLLM (.venv-wheel: a hard-linked copy of .venv with the
# editable install replaced by the wheel), then checks from outside the checkout that vLLM and
# SGLang find the loader through their entry points, that `vllm-fastload --version` prints the
# package's one version, that TGI's import hook (fastload_tgi.pth) is in site-packages, and that
# vLLM's --load-format fastload gets the loader. Run by scripts/test.sh; needs .venv (setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
source scripts/venv-copy.sh
rm -rf dist/vllm_fastload-*.whl .venv-wheel
.venv/bin/python -m build --wheel --outdir dist . >/dev/null
wheel=$(ls dist/vllm_fastload-*.whl)
echo "built $wheel"
link_copy "$root/.venv" "$root/.venv-wheel"
pip=(.venv-wheel/bin/python -m pip --quiet)
"${pip[@]}" uninstall -y vllm-fastload
"${pip[@]}" install --no-deps "$wheel"
cd "$(mktemp -d)"  # nothing of the checkout on the path from here
"$root/.venv-wheel/bin/python" - "$("$root/.venv-wheel/bin/vllm-fastload" --version)" <<'PY'
import importlib.metadata as metadata
import os
import sys
import sysconfig

import vllm_fastload

failures = []


def check(ok: bool, what: str) -> None:
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)


site = sysconfig.get_paths()["purelib"]
version = metadata.version("vllm-fastload")
check(vllm_fastload.__file__.startswith(site), f"vllm_fastload imported from the wheel ({vllm_fastload.__file__})")
check(sys.argv[1] == f"vllm-fastload {version}" and version == vllm_fastload.__version__,
      f"`vllm-fastload --version` prints {sys.argv[1]!r}; the distribution is {version}, the package "
      f"{vllm_fastload.__version__}")
check(os.path.isfile(os.path.join(site, "fastload_tgi.pth")), f"fastload_tgi.pth in {site}")
check(os.path.isfile(os.path.join(os.path.dirname(vllm_fastload.__file__), "py.typed")), "py.typed in the package")
for group, target in [("vllm.general_plugins", "vllm_fastload.vllm_plugin:register"),
                      ("sglang.srt.plugins", "vllm_fastload.sglang_plugin:register")]:
    found = [ep.value for ep in metadata.entry_points(group=group) if ep.name == "fastload"]
    check(found == [target], f"entry point fastload in {group}: {found}")

from vllm.config.load import LoadConfig  # noqa: E402
from vllm.model_executor.model_loader import get_model_loader  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402

load_general_plugins()
loader = get_model_loader(LoadConfig(load_format="fastload"))
check(type(loader).__module__ == "vllm_fastload.vllm_plugin.loader",
      f"vLLM's --load-format fastload gets {type(loader).__module__}.{type(loader).__name__}")
sys.exit(1 if failures else 0)
PY
echo "the wheel installed beside vLLM passes its checks"
