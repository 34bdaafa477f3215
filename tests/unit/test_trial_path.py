"""The shape of the trial path (issue 30), checked on the source so it cannot drift back:
one contract (``pipette.contract``), one monitor, two kinds of trial, ``workers/`` split at
the process boundary, short functions."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pipette", "workers", "service", "cli")
#: workers/ modules both sides import: torch-free, importing neither side at module level
SHARED = {"workers/spec.py", "workers/support.py", "workers/phases.py", "workers/ops.py", "workers/runtime.py",
          "workers/cpu_isa.py", "workers/probe_plan.py", "workers/fsdp_spec.py", "workers/train.py",
          "workers/__init__.py", "workers/ports.py"}
#: where a trial's kind may branch on "script": the two kinds themselves
KIND_MODULES = {"workers/host/kinds.py", "workers/host/script_trial.py"}
MAX_SCRIPT_BRANCHES = 5
MAX_FUNCTION_LINES = 60


def _files(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _imports(tree: ast.Module) -> list[tuple[str, bool]]:
    """(module imported, at module level?) for every absolute import."""
    top = set(map(id, tree.body))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            out += [(n, id(node) in top) for n in [node.module, *names]]
    return out


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def prefix_definitions(files: list[Path]) -> list[str]:
    return [f"{_rel(p)}:{n.lineno}" for p in files for n in ast.walk(_tree(p))
            if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and n.value.value == "@@pipette "]


def rank_env_builders(files: list[Path]) -> list[str]:
    """Dicts that hold both ``RANK`` and ``WORLD_SIZE``: a rank's environment built by hand."""
    out = []
    for p in files:
        for n in ast.walk(_tree(p)):
            if isinstance(n, ast.Dict) and {"RANK", "WORLD_SIZE"} <= {k.value for k in n.keys
                                                                       if isinstance(k, ast.Constant)}:
                out.append(f"{_rel(p)}:{n.lineno}")
    return out


def script_branches(files: list[Path]) -> list[str]:
    out = []
    for p in files:
        for n in ast.walk(_tree(p)):
            if isinstance(n, ast.If | ast.IfExp) and re.search(r"\bscript\b", ast.unparse(n.test)):
                out.append(f"{_rel(p)}:{n.lineno}")
    return out


def long_functions(files: list[Path]) -> list[str]:
    return [f"{_rel(p)}:{n.name} ({n.end_lineno - n.lineno + 1} lines)" for p in files for n in ast.walk(_tree(p))
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]


def test_the_event_prefix_is_defined_once() -> None:
    assert prefix_definitions(_files(*PACKAGES)) == ["pipette/contract.py:28"]


def test_a_ranks_environment_is_built_in_one_place() -> None:
    assert [x.split(":")[0] for x in rank_env_builders(_files(*PACKAGES))] == ["pipette/contract.py"]


@pytest.mark.parametrize("path", _files("workers/rank"), ids=_rel)
def test_rank_code_never_imports_host_code(path: Path) -> None:
    bad = [m for m, _ in _imports(_tree(path)) if m.startswith("workers.host")]
    assert not bad, f"{_rel(path)} runs inside a rank and imports {bad}"


@pytest.mark.parametrize("path", _files("workers/host"), ids=_rel)
def test_host_code_loads_no_torch_and_no_rank_code(path: Path) -> None:
    bad = [m for m, top in _imports(_tree(path))
           if top and (m.split(".")[0] == "torch" or m.startswith("workers.rank"))]
    assert not bad, f"{_rel(path)} watches ranks and imports {bad} at module level"


@pytest.mark.parametrize("path", [ROOT / s for s in sorted(SHARED)], ids=_rel)
def test_shared_modules_import_neither_side(path: Path) -> None:
    bad = [m for m, top in _imports(_tree(path))
           if top and (m.split(".")[0] == "torch" or m.startswith(("workers.host", "workers.rank")))]
    assert not bad, f"{_rel(path)} is shared by ranks and hosts and imports {bad}"


def test_every_workers_module_is_on_one_side() -> None:
    loose = [_rel(p) for p in _files("workers") if _rel(p) not in SHARED
             and not _rel(p).startswith(("workers/rank/", "workers/host/"))]
    assert not loose, f"put {loose} in workers/rank (inside a rank) or workers/host (launching ranks)"


def test_script_branches_live_in_the_two_kinds() -> None:
    outside = [b for b in script_branches(_files("workers")) if b.split(":")[0] not in KIND_MODULES]
    assert len(outside) <= MAX_SCRIPT_BRANCHES, outside


def test_only_the_monitor_polls_a_transport() -> None:
    """Transports poll their processes; only the monitor polls a transport (one loop)."""
    pollers = []
    for p in _files("workers/host"):
        for n in ast.walk(_tree(p)):
            if isinstance(n, ast.Call) and ast.unparse(n.func) in ("self.t.poll", "transport.poll"):
                pollers.append(_rel(p))
    assert set(pollers) == {"workers/host/monitor.py"}


def test_no_function_in_workers_is_long() -> None:
    assert long_functions(_files("workers")) == []


def test_the_checks_catch_what_they_look_for(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text('EVENT = "@@pipette "\nenv = {"RANK": "0", "WORLD_SIZE": "1"}\nif trial.script:\n    pass\n'
                   "def f():\n" + "    x = 1\n" * 61)
    files = [bad]
    global ROOT
    root, ROOT = ROOT, tmp_path
    try:
        assert prefix_definitions(files) == ["bad.py:1"]
        assert rank_env_builders(files) == ["bad.py:2"]
        assert script_branches(files) == ["bad.py:3"]
        assert long_functions(files) == ["bad.py:f (62 lines)"]
    finally:
        ROOT = root
