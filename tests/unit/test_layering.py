"""The import rules of DESIGN.md, checked on the source so they cannot rot.

pipette/ is the ground floor: numpy/scipy/optuna/pydantic/yaml and the stdlib, and nothing of
workers/, service/ or cli/, not even lazily. cli/ (the ``pipette`` command) is the composition
root: it may import pipette at the top, and workers/, the service's own pieces and the heavy
stack only inside a command's function (lazily), so ``pipette plan`` runs with the core alone.
workers/ may import pipette; service/ may import pipette and workers; nobody imports cli/, and
nobody imports service but the CLI and alembic. No module of pipette/, service/, workers/ or
cli/ imports itself back through others (``test_no_import_cycles``).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = {"torch", "deepspeed", "ray", "fastapi", "sqlalchemy", "uvicorn", "pynvml", "alembic",
         "transformers", "peft", "starlette", "psycopg"}
CORE_THIRD_PARTY = {"numpy", "scipy", "optuna", "pydantic", "yaml"}
STDLIB = set(sys.stdlib_module_names)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level module, imported at module level?) for every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            found.append((name.split(".")[0], id(node) in top_level))
    return found


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _import_nodes(path: Path) -> list[tuple[str, bool]]:
    """(dotted module, at module level?) for every absolute import in ``path``: ``from a import
    b`` reads as ``a.b``, so a rule can name a module or a package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top_level = set(map(id, tree.body))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, id(node) in top_level) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(f"{node.module}.{a.name}", id(node) in top_level) for a in node.names]
    return found


@pytest.mark.parametrize("path", _files("pipette"), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_is_pure(path: Path) -> None:
    """No arrow from pipette/ back up to workers/, service/ or cli/, at any level."""
    for module, _ in _imports(path):
        allowed = module in STDLIB or module in CORE_THIRD_PARTY or module == "pipette"
        assert allowed, f"{path.relative_to(ROOT)} imports {module!r}, which the core may not"


#: What the CLI's commands that run the service here (``serve``, ``token``) import of it.
CLI_SERVICE = ("service.admin", "service.settings", "service.auth.create_token", "service.db.Database")


@pytest.mark.parametrize("path", _files("cli"), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_cli_reaches_the_edges_lazily(path: Path) -> None:
    for module, at_top in _import_nodes(path):
        top = module.split(".")[0]
        where = f"{path.relative_to(ROOT)} imports {module!r}"
        if at_top:
            assert top in STDLIB or top in CORE_THIRD_PARTY or top in {"pipette", "cli"}, \
                f"{where} at the top: import it inside the command that needs it"
        if top == "service":
            assert module.startswith(CLI_SERVICE), f"{where}: the CLI reaches only {', '.join(CLI_SERVICE)}"


@pytest.mark.parametrize("path", [*_files("pipette"), *_files("workers"), *_files("service")],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_imports_the_cli(path: Path) -> None:
    assert all(m != "cli" for m, _ in _imports(path)), f"{path.relative_to(ROOT)} imports cli/, the top floor"


@pytest.mark.parametrize("path", _files("workers"), ids=lambda p: str(p.relative_to(ROOT)))
def test_workers_do_not_import_the_service(path: Path) -> None:
    for module, _ in _imports(path):
        assert module != "service", f"{path.relative_to(ROOT)} imports service/"


def test_alembic_imports_only_models() -> None:
    for path in _files("alembic"):
        for module, _ in _imports(path):
            assert module not in {"workers", "pipette"}, f"{path} imports {module}"


def test_checker_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n\ndef f():\n    import ray\n")
    assert _imports(bad) == [("torch", True), ("ray", False)]
    assert not {"torch", "ray"} & (STDLIB | CORE_THIRD_PARTY)
    assert {"torch", "ray"} <= HEAVY


# ---- import cycles ----------------------------------------------------------------------

CYCLE_PACKAGES = ("pipette", "service", "workers", "cli")


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages: Iterable[str] = CYCLE_PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports, read from the source under ``root``.

    Every import counts, at any level: one inside a function (a lazy import) or under
    ``TYPE_CHECKING`` is a dependency as much as one at the top, and a cycle through it is a
    cycle of the design even if Python resolves it at run time. ``from a import b`` is an
    edge to the module ``a.b`` when there is one, else to ``a``."""
    files = {_module_name(p, root): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                edges |= {a.name for a in node.names if a.name in files}
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, here)
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges |= {target} if target in files else ({base} if base in files else set())
        graph[name] = edges - {name}
    return graph


def _absolute(node: ast.ImportFrom, package: list[str]) -> str:
    """The module a ``from`` import reads from (a relative one resolved against ``package``)."""
    if not node.level:
        return node.module or ""
    parent = package[:len(package) - node.level + 1]
    return ".".join([*parent, node.module] if node.module else parent)


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_no_import_cycles() -> None:
    """Issue 30: the CLI package (``cli`` <-> ``tune``, ``client_jobs`` <-> ``client_watch``),
    ``service.admin`` <-> ``service.worker``, ``service.errors`` <-> ``service.outage``,
    ``pipette.tuner`` <-> ``result_text`` and ``pipette.memory``/``perf`` <-> ``stacks`` imported
    each other (7 cycles in 6 groups, all through lazy imports); each shared piece now lives
    where it belongs."""
    cycles = import_cycles(import_graph(ROOT))
    assert cycles == [], "modules that import each other (directly or round a loop): " + "; ".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_checker_sees_a_lazy_or_typing_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pipette"
    (tmp_path / "cli").mkdir()
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (tmp_path / "cli" / "__init__.py").write_text("from cli import tune\n")
    (tmp_path / "cli" / "tune.py").write_text("def f():\n    from cli import load\n")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n")
    (pkg / "b.py").write_text("from .a import x\n")
    (pkg / "c.py").write_text("import pipette.a\n")
    graph = import_graph(tmp_path, ("pipette", "cli"))
    assert graph["cli"] == {"cli.tune"} and graph["pipette.b"] == {"pipette.a"}
    assert import_cycles(graph) == [["cli", "cli.tune"], ["pipette.a", "pipette.b"]]
