"""apply() / revert() on a fake ``text_generation_server`` tree, and FASTLOAD_TGI=1 through the .pth line."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from tgi_helpers import same

import tgi_patch
from tgi_patch import FastWeights, activate, hook

PTH = Path(tgi_patch.__file__).with_name("fastload_tgi.pth")

FAKE_TREE = {
    "text_generation_server/__init__.py": "",
    "text_generation_server/utils/__init__.py": """
        from .weights import Weights
        __all__ = ["Weights"]
    """,
    "text_generation_server/utils/weights.py": """
        class DefaultWeightsLoader:
            def get_weights(self, weights, prefix):
                return weights.get_tensor(f"{prefix}.weight")

        class Weights:
            '''Stand-in for TGI's class; never meant to run once patched.'''
            def __init__(self, filenames, device, dtype, process_group, weights_loader, aliases=None, prefix=None):
                raise AssertionError("TGI's own Weights was constructed")

            def only_in_tgi(self):
                return "inherited from TGI's class"
    """,
    "text_generation_server/models/__init__.py": "",
    "text_generation_server/models/flash_causal_lm.py": """
        from text_generation_server.utils import Weights
        from text_generation_server.utils.weights import DefaultWeightsLoader

        class Group:
            def rank(self):
                return 0
            def size(self):
                return 1

        def load(filenames):
            import torch

            return Weights(filenames, "cpu", torch.float16, process_group=Group(), aliases=None,
                           weights_loader=DefaultWeightsLoader())
    """,
    "text_generation_server/layers/__init__.py": "",
    "text_generation_server/layers/moe.py": """
        from text_generation_server.utils.weights import Weights
    """,
    "unrelated_pkg.py": """
        from text_generation_server.utils.weights import Weights
    """,
}


def write_tree(root: Path) -> None:
    for rel, text in FAKE_TREE.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def _forget_fake_modules() -> None:
    for name in list(sys.modules):
        if name == "text_generation_server" or name.startswith("text_generation_server.") or name == "unrelated_pkg":
            del sys.modules[name]


@pytest.fixture
def fake_tgi(tmp_path: Path):
    root = tmp_path / "fake_tgi"
    write_tree(root)
    sys.path.insert(0, str(root))
    _forget_fake_modules()
    importlib.invalidate_caches()
    yield root
    activate.revert()
    hook.uninstall()
    sys.path.remove(str(root))
    _forget_fake_modules()


def test_apply_rebinds_every_importer_and_revert_restores(fake_tgi, ckpt, capsys):
    import unrelated_pkg
    from text_generation_server import utils
    from text_generation_server.models import flash_causal_lm
    from text_generation_server.utils import weights as tgi_weights

    original = tgi_weights.Weights
    assert flash_causal_lm.Weights is utils.Weights is original

    patched = tgi_patch.apply()
    assert "fastload-tgi: text_generation_server.utils.weights.Weights -> tgi_patch.FastWeights" in \
        capsys.readouterr().err
    assert tgi_weights.Weights is utils.Weights is flash_causal_lm.Weights is patched
    assert issubclass(patched, FastWeights) and issubclass(patched, original)
    assert unrelated_pkg.Weights is original  # only text_generation_server modules are touched
    assert tgi_patch.is_applied()

    w = flash_causal_lm.load([str(p) for p in ckpt])
    try:
        assert isinstance(w, original) and isinstance(w, FastWeights)
        assert w.only_in_tgi() == "inherited from TGI's class"
        assert same(w.get_weights("lm_head"), w.get_tensor("lm_head.weight"))
        assert w.get_tensor("lm_head.weight").dtype == torch.float16
    finally:
        w.close()
    capsys.readouterr()

    assert tgi_patch.apply() is patched  # idempotent: no second subclass, no second log line
    assert capsys.readouterr().err == ""

    from text_generation_server.layers import moe  # imported after the patch: gets ours from utils.weights

    assert moe.Weights is patched

    assert tgi_patch.revert() is True
    for module in (tgi_weights, utils, flash_causal_lm, moe):
        assert module.Weights is original
    assert unrelated_pkg.Weights is original
    assert not tgi_patch.is_applied()
    assert tgi_patch.revert() is False


def test_apply_imports_the_module_when_not_yet_imported(fake_tgi):
    assert "text_generation_server.utils.weights" not in sys.modules
    patched = tgi_patch.apply()
    assert sys.modules["text_generation_server.utils.weights"].Weights is patched
    assert sys.modules["text_generation_server.utils"].Weights is patched


def test_apply_after_revert_patches_again(fake_tgi):
    from text_generation_server.models import flash_causal_lm

    first = tgi_patch.apply()
    tgi_patch.revert()
    second = tgi_patch.apply()
    assert flash_causal_lm.Weights is second
    assert issubclass(second, FastWeights) and first.__mro__[2] is second.__mro__[2]


def test_apply_without_tgi_is_a_clear_import_error():
    assert "text_generation_server" not in sys.modules
    with pytest.raises(ModuleNotFoundError, match="text_generation_server"):
        tgi_patch.apply()
    assert not tgi_patch.is_applied()


def test_non_class_weights_gets_the_standalone_class(fake_tgi):
    from text_generation_server.utils import weights as tgi_weights

    sentinel = types.SimpleNamespace()
    tgi_weights.Weights = sentinel
    assert tgi_patch.apply() is FastWeights
    tgi_patch.revert()
    assert tgi_weights.Weights is sentinel


def test_import_hook_patches_before_anyone_binds_the_name(fake_tgi):
    """In-process: the finder wraps utils.weights' loader; utils/__init__ then imports ours."""
    hook.install()
    from text_generation_server.models import flash_causal_lm
    from text_generation_server.utils import weights as tgi_weights

    assert issubclass(flash_causal_lm.Weights, FastWeights)
    assert flash_causal_lm.Weights is tgi_weights.Weights
    assert tgi_weights.__spec__.origin.endswith("weights.py")
    hook.install()  # idempotent: one finder only
    assert sum(isinstance(f, hook._WeightsFinder) for f in sys.meta_path) == 1


def test_enabled_values():
    assert not hook.enabled({})
    for off in ("", "0", "false", "No", " off "):
        assert not hook.enabled({"FASTLOAD_TGI": off})
    for on in ("1", "true", "yes", "on", "2"):
        assert hook.enabled({"FASTLOAD_TGI": on})


# -- FASTLOAD_TGI=1 in fresh interpreters: the .pth line exactly as site.py runs it ----------------
def run_with_pth(fake_root: Path, tmp_path: Path, env_value: str | None, code: str, *args: str):
    """Run ``code`` in a fresh interpreter whose extra site dir holds a copy of tgi_patch's .pth.

    ``site.addsitedir`` processes .pth files exactly as interpreter start-up does for site-packages.
    """
    site_dir = tmp_path / "site"
    site_dir.mkdir(exist_ok=True)
    (site_dir / PTH.name).write_text(PTH.read_text())
    env = {k: v for k, v in os.environ.items() if k != "FASTLOAD_TGI"}
    if env_value is not None:
        env["FASTLOAD_TGI"] = env_value
    env["PYTHONPATH"] = os.pathsep.join([str(fake_root), str(Path(tgi_patch.__file__).parents[1])])
    prelude = f"import site, sys; site.addsitedir({str(site_dir)!r})\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code), *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_pth_file_is_one_import_line():
    lines = [line for line in PTH.read_text().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("import ")


def test_fastload_tgi_1_patches_every_shard_process(fake_tgi, tmp_path, ckpt):
    code = f"""
        from text_generation_server.models import flash_causal_lm
        from text_generation_server.layers import moe
        import text_generation_server.utils as utils
        import tgi_patch
        w = flash_causal_lm.load({[str(p) for p in ckpt]!r})
        print(type(w).__mro__[1].__module__, utils.Weights is moe.Weights is flash_causal_lm.Weights,
              w.get_tensor("lm_head.weight").dtype, tgi_patch.is_applied())
    """
    proc = run_with_pth(fake_tgi, tmp_path, "1", code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["tgi_patch.weights", "True", "torch.float16", "True"]
    assert "fastload-tgi: text_generation_server.utils.weights.Weights -> tgi_patch.FastWeights (1 module " \
        "rebound" in proc.stderr  # patched before utils/__init__ bound the name


def test_launcher_sees_the_activation_line(fake_tgi, tmp_path):
    """Shards run with --json-output: the line must be a loguru-style JSON record on stdout."""
    proc = run_with_pth(fake_tgi, tmp_path, "1", "import text_generation_server.utils", "--json-output")
    assert proc.returncode == 0, proc.stderr
    record = json.loads(proc.stdout.strip())
    assert record["record"]["level"]["name"] == "INFO"
    assert record["text"].startswith("fastload-tgi: text_generation_server.utils.weights.Weights")


@pytest.mark.parametrize("value", [None, "0"])
def test_unset_or_off_costs_nothing(fake_tgi, tmp_path, value):
    """Unset: the .pth line imports nothing at all. "0": only the tiny hook module, which does nothing."""
    code = """
        import sys
        hook_loaded = "tgi_patch.hook" in sys.modules
        from text_generation_server.models import flash_causal_lm
        print(hook_loaded, "tgi_patch.weights" in sys.modules, flash_causal_lm.Weights.__module__,
              [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_WeightsFinder"])
    """
    proc = run_with_pth(fake_tgi, tmp_path, value, code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(value is not None), "False", "text_generation_server.utils.weights", "[]"]
    assert proc.stderr == ""


def test_pth_is_installed_into_site_packages():
    """The installed package (pip install, editable or not) puts the switch where Python reads it."""
    import site

    dirs = [*site.getsitepackages(), site.getusersitepackages()]
    installed = [p for p in (os.path.join(d, "fastload_tgi.pth") for d in dirs) if os.path.exists(p)]
    assert installed, f"fastload_tgi.pth not in {dirs}"
    with open(installed[0]) as f:
        assert f.read().startswith("import ")
    env = {**os.environ, "FASTLOAD_TGI": "1"}
    out = subprocess.run([sys.executable, "-c", "import sys; print(type(sys.meta_path[0]).__name__)"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == "_WeightsFinder", out.stderr
    env["FASTLOAD_TGI"] = ""
    out = subprocess.run([sys.executable, "-c", "import sys; print('tgi_patch' in sys.modules)"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.strip() == "False"
