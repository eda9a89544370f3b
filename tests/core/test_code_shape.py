"""Functions stay small enough to read in one screen: no function of the package (outside
``LEFT_OUT``) over ``MAX_LINES`` lines or ``MAX_BRANCHES`` branches."""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_fastload

MAX_LINES = 60
MAX_BRANCHES = 20
PACKAGE = Path(vllm_fastload.__file__).parent
#: Left out, with why: benchmark code (off the runtime path).
LEFT_OUT = ("bench",)
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
