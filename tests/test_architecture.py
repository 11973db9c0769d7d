"""The layering the code promises (giantmodel/__init__.py): imports flow one
way, no module import cycle exists, function-local imports of giantmodel
modules are rare and say why, and ruff is clean."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "giantmodel"
LOCAL_IMPORT_BUDGET = 15


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(shutil.which("lint-imports") is None, reason="import-linter not installed")
def test_import_linter_contract_holds():
    proc = _run(["lint-imports"])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_module_import_cycle():
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("giantmodel")
    adj = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    cycles = _strongly_connected(adj)
    assert not cycles, f"import cycles: {cycles}"


def _strongly_connected(adj: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components with more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in adj:
        if root in index:
            continue
        work = [(root, iter(sorted(adj[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(adj.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.append(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _local_giantmodel_imports() -> list[tuple[str, int, bool]]:
    """(file, line, has a reason comment) for each giantmodel import inside a function."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        lines = source.splitlines()
        for fn in ast.walk(ast.parse(source)):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom):
                    names = [node.module or ""]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                if any(n == "giantmodel" or n.startswith("giantmodel.") for n in names):
                    near = lines[max(0, node.lineno - 2):node.lineno]
                    found.append((str(path.relative_to(ROOT)), node.lineno,
                                  any("lazy" in line for line in near)))
    return found


def test_function_local_imports_are_few_and_explained():
    found = _local_giantmodel_imports()
    assert len(found) < LOCAL_IMPORT_BUDGET, found
    unexplained = [(f, n) for f, n, ok in found if not ok]
    assert not unexplained, f"say why each is lazy (a comment with 'lazy'): {unexplained}"


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed")
def test_ruff_is_clean():
    proc = _run([sys.executable, "-m", "ruff", "check", "giantmodel", "tests", "benchmarks"])
    assert proc.returncode == 0, proc.stdout[-4000:]
