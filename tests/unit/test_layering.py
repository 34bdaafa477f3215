"""The import rules of DESIGN.md, checked on the source so they cannot rot.

pipette/ is pure: numpy/scipy/optuna/pydantic/yaml and the stdlib. Only pipette/cli/ may
reach workers/ and service/ (and their heavy stack), and only inside a function (lazily).
workers/ may import pipette; service/ may import pipette and workers; nobody imports service
but the CLI and alembic.
"""

from __future__ import annotations

import ast
import sys
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


@pytest.mark.parametrize("path", _files("pipette"), ids=lambda p: str(p.relative_to(ROOT)))
def test_core_is_pure(path: Path) -> None:
    for module, at_top in _imports(path):
        if "cli" in path.relative_to(ROOT).parts[:2] and not at_top:
            continue  # the CLI reaches the edges lazily, per command
        allowed = module in STDLIB or module in CORE_THIRD_PARTY or module == "pipette"
        assert allowed, f"{path.relative_to(ROOT)} imports {module!r}, which the core may not"


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
