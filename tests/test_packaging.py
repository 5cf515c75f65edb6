"""What gets installed, and what may import what.

Three layers, each importing only itself and the layers before it: ``selfspec`` (the library),
``selfspec_eval`` (eval/, the benchmark), ``selfspec_cli`` (cli/, the ``selfspec`` command). The
library imports neither of them, nor the repository's scripts (training/) or tests, and never finds
files through its own location (``__file__``): installed from a wheel there is no repository around it.
No import circle anywhere, lazy imports inside functions included, between modules or between packages.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"selfspec": ROOT / "selfspec", "selfspec_eval": ROOT / "eval", "selfspec_cli": ROOT / "cli"}
NOT_FROM_LIBRARY = {"selfspec_eval", "selfspec_cli", "eval", "cli", "training", "tests", "conftest"}


def test_every_package_is_installed():
    """pyproject lists packages by hand (eval/ and cli/ are mapped to their names): none may be forgotten."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "selfspec").rglob("__init__.py")}
    assert found | {"selfspec_eval", "selfspec_cli"} == listed
    assert not [p for p in (ROOT / "eval").rglob("__init__.py") if p.parent != ROOT / "eval"]  # no subpackages
    assert not [p for p in (ROOT / "cli").rglob("__init__.py") if p.parent != ROOT / "cli"]


def module_files() -> dict[str, Path]:
    """Dotted name -> file of every module of the three layers."""
    out = {}
    for package, folder in LAYERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            out[".".join((package, *parts[:-1], *([] if parts[-1] == "__init__" else parts[-1:])))] = path
    return out


def _type_checking_only(tree: ast.AST) -> set[int]:
    """Ids of the nodes under ``if TYPE_CHECKING:`` (imports for annotations, never run)."""
    blocks = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
    return {id(inner) for block in blocks for inner in ast.walk(block)}


def imported_names(name: str, path: Path) -> set[str]:
    """Every dotted name ``name`` imports, anywhere in the file (function bodies too), relative ones resolved;
    ``from a import b`` gives both ``a`` and ``a.b`` (b may be a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    skip = _type_checking_only(tree)
    names = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return names


def import_graph() -> dict[str, set[str]]:
    """Module -> the modules of the three layers its imports run: the named module and every package above it
    (their ``__init__`` runs first), except the importer's own packages, which are already running."""
    files = module_files()
    graph = {}
    for name, path in files.items():
        edges = set()
        for target in imported_names(name, path):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                mod = ".".join(parts[:i])
                if mod in files and mod != name and not name.startswith(mod + "."):
                    edges.add(mod)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_lazy_circle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_circle() -> None:
    graph = import_graph()
    assert "selfspec.frozen" in graph and "selfspec_cli.main" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph with every module of a subpackage (``selfspec.heads.eagle``) folded into its package
    (``selfspec.heads``); a top-level module of a layer stays itself."""
    packages = {n for n, p in module_files().items() if p.name == "__init__.py" and n.count(".") == 1}

    def node(name: str) -> str:
        top = ".".join(name.split(".")[:2])
        return top if top in packages else name

    out: dict[str, set[str]] = {}
    for name, edges in graph.items():
        out.setdefault(node(name), set()).update(node(e) for e in edges if node(e) != node(name))
    return out


def test_no_package_imports_one_that_imports_it_back() -> None:
    """Between packages too: ``heads`` importing ``train``'s objectives while ``train`` imports ``heads`` is a loop
    even when no two modules form one (a training objective is a leaf both import: ``selfspec.objectives``)."""
    packages = package_graph(import_graph())
    assert {"selfspec.heads", "selfspec.train", "selfspec.objectives"} <= set(packages)
    assert find_cycle(packages) is None, " -> ".join(find_cycle(packages))
    assert find_cycle(package_graph({"selfspec.heads.a": {"selfspec.train.b"}, "selfspec.train.b": set(),
                                     "selfspec.train.c": {"selfspec.heads.d"}, "selfspec.heads.d": set()})) is not None


def test_each_layer_imports_only_the_layers_before_it() -> None:
    order = list(LAYERS)
    files = module_files()
    wrong = []
    for name, path in files.items():
        layer = order.index(name.split(".")[0])
        top = {target.split(".")[0] for target in imported_names(name, path)}
        wrong += [f"{name} imports {t}" for t in top if t in order and order.index(t) > layer]
        if layer == 0:
            wrong += [f"{name} imports {t}" for t in top & NOT_FROM_LIBRARY]
    assert not wrong


def test_the_library_never_locates_the_repository() -> None:
    """No ``__file__`` under selfspec/: files a command needs come from its options (e.g. --heads-path)."""
    found = [name for name, path in module_files().items() if name.split(".")[0] == "selfspec"
             and any(isinstance(n, ast.Name) and n.id == "__file__" for n in ast.walk(ast.parse(path.read_text())))]
    assert not found


def test_every_library_module_imports_alone_without_eval_cli_or_training() -> None:
    """In a fresh interpreter: each module imports, and none of them pulls in a later layer or a script."""
    mods = sorted(name for name in module_files() if name.split(".")[0] == "selfspec")
    code = ("import importlib, sys\n"
            f"for m in {mods!r}:\n    importlib.import_module(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(NOT_FROM_LIBRARY)!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT / "tests",
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
