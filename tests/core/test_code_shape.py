"""Functions stay small enough to read in one screen: no function of the package (outside
``LEFT_OUT``) over ``MAX_LINES`` lines or ``MAX_BRANCHES`` branches."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_fastload

MAX_LINES = 60
MAX_BRANCHES = 20
PACKAGE = Path(vllm_fastload.__file__).parent
#: Left out, with why: nothing (the benchmarks and tools too are read and changed).
LEFT_OUT: tuple[str, ...] = ()
_BRANCHING = (ast.If, ast.IfExp, ast.For, ast.AsyncFor, ast.While, ast.ExceptHandler, ast.With, ast.AsyncWith,
              ast.BoolOp, ast.comprehension, ast.match_case)
_NESTED = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _own_nodes(node: ast.AST):
    """The nodes of a function's own body: nested functions and classes are measured on their own."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, _NESTED):
            yield from _own_nodes(child)


def function_sizes(root: Path = PACKAGE) -> list[tuple[int, int, str]]:
    """``(lines, branches, where)`` of every function under ``root`` outside ``LEFT_OUT``, longest first."""
    sizes = []
    for path in sorted(root.rglob("*.py")):
        if any(part in LEFT_OUT for part in path.relative_to(root).parts):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                branches = sum(isinstance(n, _BRANCHING) for n in _own_nodes(node))
                sizes.append((lines, branches, f"{path.relative_to(root.parent)}:{node.lineno} {node.name}"))
    return sorted(sizes, reverse=True)


def test_no_function_is_too_long_or_too_branched() -> None:
    sizes = function_sizes()
    assert sizes, "no function found: the walk is broken"
    too_long = [s for s in sizes if s[0] > MAX_LINES]
    too_branched = [s for s in sizes if s[1] > MAX_BRANCHES]
    assert not too_long and not too_branched, (too_long, too_branched)


def test_the_measure(tmp_path: Path) -> None:
    """Lines from ``def`` to the last line; branches of the function's own body (a nested function
    counts for itself), a comprehension and a boolean operator counting one each."""
    (tmp_path / "m.py").write_text(
        "def f(x):\n"
        "    if x:\n"
        "        return [y for y in x if y]\n"
        "    def g(a):\n"
        "        if a or not a:\n"
        "            pass\n"
        "    return g\n")
    sizes = {where.rsplit(" ", 1)[1]: (lines, branches) for lines, branches, where in function_sizes(tmp_path)}
    assert sizes == {"f": (7, 2), "g": (3, 2)}


# -- adapters reach the core through its public names only ------------------------------------------

#: The adapters' side: the engine adapters and the rank loading they share (``model``), and TGI's.
ADAPTERS = ("vllm_plugin", "sglang_plugin", "model")
#: Neither core nor adapter: tooling (benchmarks, test and demo helpers, the command line).
TOOLING = ("bench", "tools", "cli.py", "tp_rules.py", "__main__.py")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__") and name != "_"


def core_private_names(package: Path = PACKAGE) -> set[str]:
    """The private names the core defines: functions, classes, methods, module globals and
    attributes it sets (``self._x = ...``)."""
    names: set[str] = set()
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] in ADAPTERS + TOOLING:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                if isinstance(node, ast.AnnAssign) else []
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if _private(n)}


def private_reaches(roots: list[Path], private: set[str], own: str = "vllm_fastload") -> list[str]:
    """Where a module under ``roots`` imports a private name from the core (``own``'s modules
    outside the adapters), or reaches a private name the core defines on anything but itself
    (``self``, ``cls``)."""
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                where = f"{path.relative_to(root.parent)}:{getattr(node, 'lineno', 0)}"
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == own \
                        and not any(f".{a}" in f".{node.module}" for a in ADAPTERS):
                    found += [f"{where} imports {a.name}" for a in node.names if _private(a.name)]
                elif isinstance(node, ast.Attribute) and node.attr in private \
                        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                    found.append(f"{where} reaches .{node.attr}")
    return found


def test_no_adapter_reaches_a_private_name_of_the_core() -> None:
    """The engine adapters load through the core's public interface (``FastCheckpoint.read_into``
    with ``ReadHooks``): what the core keeps private can change without breaking them."""
    private = core_private_names()
    assert "_execute" in private and "_read_owned" in private, "the core's private names were not found"
    roots = [PACKAGE / a for a in ADAPTERS] + [PACKAGE.parent / "tgi_patch"]
    assert private_reaches(roots, private) == []


def test_the_rule_on_adapters(tmp_path: Path) -> None:
    """What the rule catches: a private import from the core, a private name of the core reached on
    an object; what it lets pass: the adapter's own privates, and the core's public names."""
    core = tmp_path / "vllm_fastload"
    (core / "model").mkdir(parents=True)
    (core / "api.py").write_text("class FastCheckpoint:\n"
                                 "    def _read_into(self): self._stats = 1\n"
                                 "    def read_into(self): return self._read_into()\n"
                                 "_CACHE = {}\n")
    (core / "model" / "rank.py").write_text("from vllm_fastload.api import FastCheckpoint, _CACHE\n"
                                            "def _own(ckpt):\n"
                                            "    ckpt.read_into()\n"
                                            "    ckpt._read_into()\n"
                                            "    return ckpt._stats, _own\n")
    private = core_private_names(core)
    assert private == {"_read_into", "_stats", "_CACHE"}
    assert private_reaches([core / "model"], private) == ["model/rank.py:1 imports _CACHE",
                                                          "model/rank.py:4 reaches ._read_into",
                                                          "model/rank.py:5 reaches ._stats"]


# -- one door: the adapters import the core through the package root and ``vllm_fastload.model`` only --

#: The engine adapters, with the package each may also import from (its own).
ENGINE_ADAPTERS = {PACKAGE / "vllm_plugin": "vllm_fastload.vllm_plugin",
                   PACKAGE / "sglang_plugin": "vllm_fastload.sglang_plugin",
                   PACKAGE.parent / "tgi_patch": "tgi_patch"}
#: Below the adapters' shared layer: modules that must not import the root's names (the root imports
#: lazily, so an upward import through it would pass the import contracts unseen).
BELOW_MODEL = [p for p in PACKAGE.iterdir() if p.name not in ("model", "__init__.py", "__main__.py", "__pycache__")
               and p.name not in ADAPTERS + TOOLING]


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of each import in a file (``names`` empty for ``import x``), and
    each attribute taken of the package root (``vllm_fastload.x``) as an import of ``x`` from it."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "vllm_fastload":
            found.append((node.lineno, "vllm_fastload", [node.attr]))
    return found


def door_violations(root: Path, own: str, door: set[str], model: set[str]) -> list[str]:
    """Where a module under ``root`` imports ``vllm_fastload`` other than through the door (the
    root's public names, ``door``) and ``vllm_fastload.model``'s (``model``), or its own package ``own``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for line, module, names in _imports(path):
            where = f"{path.relative_to(root.parent)}:{line}"
            if module == own or module.startswith(own + ".") or module.split(".")[0] != "vllm_fastload":
                continue
            if not names and module in ("vllm_fastload", "vllm_fastload.model"):
                continue  # the door itself (``import vllm_fastload``), its names used as attributes
            allowed = door if module == "vllm_fastload" else model if module == "vllm_fastload.model" else set()
            found += [f"{where} imports {module}" + (f".{n}" if names else "") for n in (names or [""])
                      if not names or n not in allowed]
    return found


def test_the_engine_adapters_import_the_core_only_through_its_door() -> None:
    import vllm_fastload.model

    door, model = set(vllm_fastload.__all__), set(vllm_fastload.model.__all__)
    assert {"open", "FastCheckpoint", "ReadHooks", "FastloadConfig", "LoadReport", "LayerEvent"} <= door
    assert {"load_rank", "loader_config", "start_early_reads", "loading"} <= model
    found = [v for root, own in ENGINE_ADAPTERS.items() for v in door_violations(root, own, door, model)]
    assert found == []


def test_nothing_below_the_model_imports_the_door() -> None:
    found = []
    for place in BELOW_MODEL:
        for path in [place] if place.is_file() else sorted(place.rglob("*.py")):
            found += [f"{path.relative_to(PACKAGE)}:{line} imports {n} from the package root"
                      for line, module, names in _imports(path) if module == "vllm_fastload"
                      for n in names if n in vllm_fastload.__all__] + \
                     [f"{path.relative_to(PACKAGE)}:{line} imports the package root"
                      for line, module, names in _imports(path) if module == "vllm_fastload" and not names]
    assert BELOW_MODEL and found == []


@pytest.mark.parametrize("door", ["vllm_fastload", "vllm_fastload.model"])
def test_each_door_hands_out_what_its_modules_define(door: str) -> None:
    """Both doors import on first use: every name they list resolves, to the object its module
    defines, and shows in ``dir()``."""
    module = importlib.import_module(door)
    tree = ast.parse(Path(module.__file__).read_text())
    typed = {a.asname or a.name: (node.module, a.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             and node.module and node.module.startswith("vllm_fastload.") for a in node.names}
    assert set(module.__all__) == set(typed) and set(module.__all__) <= set(dir(module))
    for name in module.__all__:
        home, defined = typed[name]
        assert getattr(module, name) is getattr(importlib.import_module(home), defined), name


def test_registering_with_sglang_imports_neither_the_configuration_nor_the_loading_code() -> None:
    """SGLang runs ``register`` in every process it starts, whatever the load format: what it needs
    of the core (``missing_targets``) comes without pydantic's models or the loader."""
    code = ("import sys; from vllm_fastload.model import missing_targets; missing_targets({}); "
            "print(sorted(m for m in sys.modules if m.startswith(('vllm_fastload.', 'pydantic', 'torch'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == str(["vllm_fastload.errors", "vllm_fastload.events", "vllm_fastload.format",
                                      "vllm_fastload.frozen", "vllm_fastload.layers", "vllm_fastload.model"])


def test_the_door_rule(tmp_path: Path) -> None:
    """What the rule catches: a core module imported by path, a name the door does not export; what
    it lets pass: the door's names, the model's, the adapter's own modules, other packages."""
    adapter = tmp_path / "vllm_plugin"
    adapter.mkdir()
    (adapter / "loader.py").write_text("import torch\n"
                                       "from vllm_fastload import FastCheckpoint, policy\n"
                                       "from vllm_fastload.model import load_rank\n"
                                       "from vllm_fastload.model.rank import _Load\n"
                                       "from vllm_fastload.vllm_plugin import compat\n"
                                       "import vllm_fastload.api\n"
                                       "import vllm_fastload\n"
                                       "vllm_fastload.open(vllm_fastload.checkpoint)\n")
    found = door_violations(adapter, "vllm_fastload.vllm_plugin", {"FastCheckpoint", "open"}, {"load_rank"})
    assert found == ["vllm_plugin/loader.py:2 imports vllm_fastload.policy",
                     "vllm_plugin/loader.py:4 imports vllm_fastload.model.rank._Load",
                     "vllm_plugin/loader.py:6 imports vllm_fastload.api",
                     "vllm_plugin/loader.py:8 imports vllm_fastload.checkpoint"]
