"""The Python package is a one-way graph (shared/style.md item 16): no import cycle among the
modules under python/tiermem, and no import inside a function except of an optional third-party
package (listed below with where it may be imported). Parsed with ast, nothing imported, so this
runs without torch and without the extension.

TIERMEM_LAYOUT_ROOT=<dir holding tiermem/> checks another tree (the old code fails both tests)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(os.environ.get("TIERMEM_LAYOUT_ROOT",
                           Path(__file__).resolve().parents[2] / "python"))

# Optional third-party packages a function may import (the feature that needs one imports it when
# it runs, so the package works without it): package -> the files allowed to ("*": any file).
OPTIONAL = {
    "torch": {"tiermem/__init__.py"},  # aio_handle takes numpy arrays or, when torch is there, torch tensors
    "transformers": {"*"},
    "deepspeed": {"*"},
    "peft": {"*"},
    "accelerate": {"*"},
    "trl": {"*"},
}


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under root/tiermem."""
    out = {}
    for path in sorted((root / "tiermem").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(name: str, path: Path, modules: dict[str, Path]):
    """(target module, node) for each import in the file that names a module of the package: a
    `from X import y` names X.y when that is a module, else X."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    pkg = _package_of(name, path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    yield a.name, node
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - (node.level - 1)]
                base = ".".join(base + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in modules:
                    yield sub, node
                elif base in modules:
                    yield base, node


def _graph(root: Path) -> dict[str, set[str]]:
    modules = _modules(root)
    return {name: {t for t, _ in _imports(name, path, modules) if t != name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]):
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = visit(t)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def _function_imports(root: Path) -> list[str]:
    """'file:line import ...' for each import inside a function that the allow-list does not cover."""
    bad = []
    for name, path in _modules(root).items():
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    targets = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    targets = ["." * node.level + (node.module or "")]
                else:
                    continue
                for t in targets:
                    allowed = OPTIONAL.get(t.split(".")[0]) if not t.startswith(".") else None
                    if allowed is None or not ("*" in allowed or rel in allowed):
                        bad.append(f"{rel}:{node.lineno} imports {t} inside {getattr(fn, 'name', 'a lambda')}()")
    return sorted(set(bad))


def test_tree_is_there():
    modules = _modules(ROOT)
    assert "tiermem" in modules and "tiermem.torch" in modules, f"no tiermem package under {ROOT}"
    assert len(modules) >= 8, sorted(modules)


def test_no_import_cycle():
    graph = _graph(ROOT)
    # The graph is real: the public API imports the engine, the engine its hooks.
    assert "tiermem.torch.engine" in graph["tiermem.torch"]
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_function_level_import():
    bad = _function_imports(ROOT)
    assert not bad, "imports inside functions (import at the top of the module, or move what is shared into a " \
                    "leaf module; optional third-party packages go in OPTIONAL):\n" + "\n".join(bad)


def test_checker_sees_cycles_and_local_imports(tmp_path):
    """The checks themselves on a tree made to fail them."""
    pkg = tmp_path / "tiermem"
    (pkg / "torch").mkdir(parents=True)
    (pkg / "__init__.py").write_text("def f():\n    import torch\n    import json\n")
    (pkg / "torch" / "__init__.py").write_text("from .engine import x\n")
    (pkg / "torch" / "engine.py").write_text("from ._hooks import y\nx = 1\n")
    (pkg / "torch" / "_hooks.py").write_text("from . import engine\ny = 2\n"
                                             "def g():\n    from .engine import x\n    import transformers\n")
    assert _cycle(_graph(tmp_path)) in (["tiermem.torch._hooks", "tiermem.torch.engine", "tiermem.torch._hooks"],
                                        ["tiermem.torch.engine", "tiermem.torch._hooks", "tiermem.torch.engine"])
    bad = _function_imports(tmp_path)
    assert bad == ["tiermem/__init__.py:3 imports json inside f()",
                   "tiermem/torch/_hooks.py:4 imports .engine inside g()"], bad


@pytest.mark.parametrize("module", ["tiermem.torch._params", "tiermem.torch._config", "tiermem.torch._init_store"])
def test_leaves_import_nothing_above_them(module):
    """The shared leaves import no other module of tiermem.torch except leaves."""
    graph = _graph(ROOT)
    assert module in graph, f"{module} missing"
    leaves = {"tiermem.torch._params", "tiermem.torch._config", "tiermem.torch._init_store", "tiermem.torch._malloc"}
    above = {t for t in graph[module] if t.startswith("tiermem.torch") and t not in leaves}
    assert not above, f"{module} imports {sorted(above)}"
