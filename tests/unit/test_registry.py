"""One registry of trial kinds (issue 44): "Pipette's runner or the user's script?" and "which
stack?" are asked of ``pipette.registry`` (and the two kinds in workers/host), not branched on
again in the command line, the service and its driver. Counted on the source so it cannot drift."""

from __future__ import annotations

import ast
import re
from dataclasses import replace
from pathlib import Path

import pytest

from pipette.config import ParallelConfig
from pipette.errors import SpecError
from pipette.model import ModelSpec
from pipette.registry import (
    RunnerKind,
    ScriptKind,
    candidate_refusals,
    job_key_fields,
    job_kind,
    runner_of,
    script_from_record,
    script_record,
    traceable,
)
from pipette.runners import DEEPSPEED_RUNNER, NATIVE_RUNNER, Runner
from pipette.script import KINDS, ScriptSpec, bind_stack
from pipette.stacks import FSDP, HF_DEEPSPEED, PIPETTE, SCRIPT_KIND_STACKS, STACKS, get_stack, rank_layout, stack_layout
from pipette.training import TrainingSpec

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pipette", "workers", "service", "cli")
#: the registry and the two kinds of trial it names (workers.host.kinds, the script's own kind)
REGISTRY = {"pipette/registry.py", "workers/host/kinds.py", "workers/host/script_trial.py"}
#: the stacks' names, matched as strings where a branch picks a stack by hand
STACK_NAMES = {"pipette", "hf-deepspeed", "megatron", "nanotron", "fsdp"}
#: branches left outside the registry: 39 before it (48 in all, 9 of them in the two kinds), 19 with
#: it, 6 since each stack's entry holds its runner and its script rules (issue 44 aimed at 8). The 6:
#: cli/tune.py's --script flag checks (given? empty?), ScriptSpec.command's ``fsdp`` knob (a knob's
#: name, not the stack), script_faults' knobs of an unknown script, the service unpacking a job's
#: script and naming the runner's Llama-only model in its submit error
MAX_OUTSIDE = 6


def _is_script(e: ast.expr) -> bool:
    name = e.id if isinstance(e, ast.Name) else e.attr if isinstance(e, ast.Attribute) else ""
    return re.fullmatch(r"\w*script", name) is not None


def _asks_runner_or_script(test: ast.expr) -> bool:
    """``script``, ``not script``, ``script is (not) None`` (alone or in an and/or)."""
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        return _asks_runner_or_script(test.operand)
    if isinstance(test, ast.BoolOp):
        return any(_asks_runner_or_script(v) for v in test.values)
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Is | ast.IsNot):
        return _is_script(test.left)
    return _is_script(test)


def _matches_a_stack(test: ast.expr) -> bool:
    """A comparison with a stack's name (``== "fsdp"``, ``in ("fsdp", ...)``) or ``DEFAULT_STACK``."""
    for n in ast.walk(test):
        if isinstance(n, ast.Compare):
            sides = [n.left, *n.comparators]
            items = [e for s in sides for e in (s.elts if isinstance(s, ast.Tuple | ast.Set | ast.List) else [s])]
            if any((isinstance(e, ast.Constant) and e.value in STACK_NAMES)
                   or (isinstance(e, ast.Name) and e.id == "DEFAULT_STACK") for e in items):
                return True
    return False


def _asks_the_kind_by_type(test: ast.expr) -> bool:
    return "RunnerKind" in ast.unparse(test) or "ScriptKind" in ast.unparse(test)


def kind_branches(files: list[Path], root: Path = ROOT) -> list[str]:
    """Every if / conditional expression / while that decides runner or script, or a stack by its
    name, or a trial kind by its class: ``path:line``."""
    out = []
    for p in files:
        for n in ast.walk(ast.parse(p.read_text(), filename=str(p))):
            test = n.test if isinstance(n, ast.If | ast.IfExp | ast.While) else None
            if test is not None and (_asks_runner_or_script(test) or _matches_a_stack(test)
                                     or _asks_the_kind_by_type(test)):
                out.append(f"{p.relative_to(root)}:{n.lineno}")
    return out


def _outside() -> list[str]:
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    return [b for b in kind_branches(files) if b.split(":")[0] not in REGISTRY]


def test_runner_or_script_is_asked_of_the_registry() -> None:
    outside = _outside()
    assert len(outside) <= MAX_OUTSIDE, f"{len(outside)} branches outside the registry: {outside}"


def test_the_counter_sees_each_form(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("if script is None:\n    pass\nx = 1 if job.script else 2\nif stack == 'fsdp':\n    pass\n"
                   "if name in ('megatron', 'x'):\n    pass\nif isinstance(k, RunnerKind):\n    pass\n"
                   "if scripts_total > 3:\n    pass\n")
    assert sorted(kind_branches([bad], tmp_path)) == ["bad.py:1", "bad.py:3", "bad.py:4", "bad.py:6", "bad.py:8"]


def test_the_kinds_answer_as_the_branches_did() -> None:
    """The answers the CLI, the routes and the driver computed by hand before (issue 44)."""
    runner = job_kind("pipette,fsdp", None)
    assert isinstance(runner, RunnerKind) and [s.key for s in runner.stacks] == ["pipette", "fsdp"]
    assert runner.runner_stack == "pipette" and runner.learns_from_other_jobs and not runner.runs_user_code
    assert job_kind("fsdp", None).runner_stack == "fsdp" and runner.store_suffix(lambda s: "k") == ""
    script = ScriptSpec(argv=("python", "train.py"), kind="hf-trainer")
    under_fsdp = job_kind("fsdp", script)
    assert isinstance(under_fsdp, ScriptKind) and under_fsdp.script.fsdp  # bound to its stack
    assert under_fsdp.runner_stack == "pipette" and not under_fsdp.learns_from_other_jobs
    assert under_fsdp.store_suffix(lambda s: "abc") == "-script-abc" and under_fsdp.runs_user_code
    ds = job_kind(None, script)
    assert not ds.script.fsdp and ds.stack.key == "hf-deepspeed"
    assert ds.launch_files(None, None, None, None, ds.stack)[-1] == "launch-accelerate.sh"  # type: ignore[arg-type]


def test_each_stack_entry_names_its_runner_and_its_scripts() -> None:
    """What used to be branches on a stack's name is data of its entry (issue 44)."""
    assert {n: s.runner for n, s in STACKS.items() if s.runner is not None} == \
        {"pipette": DEEPSPEED_RUNNER, "fsdp": NATIVE_RUNNER}
    assert runner_of("pipette").rank_args() == ["-m", "workers.rank.train", "--deepspeed_config", "ds_config.json",
                                                "--candidate", "candidate.json"]
    assert runner_of("fsdp").rank_args() == ["-m", "workers.rank.fsdp", "--candidate", "candidate.json"]
    with pytest.raises(SpecError, match="cannot be tuned by Pipette's runner"):
        runner_of("megatron")
    assert SCRIPT_KIND_STACKS == {"hf-trainer": "hf-deepspeed", "accelerate-fsdp": "fsdp", "torchtitan": "fsdp"}
    assert set(SCRIPT_KIND_STACKS) <= set(KINDS)
    assert traceable(get_stack("fsdp+compile")) and not traceable(PIPETTE) and not traceable(get_stack("megatron"))
    assert job_key_fields((PIPETTE,)) == {} and job_key_fields((PIPETTE, FSDP)) == {"stack": "pipette,fsdp"}
    script = ScriptSpec(argv=("python", "train.py"), kind="hf-trainer")
    assert script_from_record(script_record(script)) == script and script_record(None) is None


def test_a_new_stack_is_its_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stack Pipette runs that no code names: its entry (here registered in ``STACKS`` as a new
    one would be) is all the registry, the trial's checks and the host's launch read, with no
    branch on its name anywhere (docs/stacks.md, "Adding a stack")."""
    from workers.host.kinds import RunnerTrial, runs_deepspeed
    from workers.spec import TrialSpec
    from workers.support import refusals_for

    refused = ["the toy runner has no pipeline"]
    toy = replace(FSDP, name="toy", runner=Runner(entry="workers.rank.toy", deepspeed=False,
                                                  refusals=lambda m, t, c, d: refused if c.pp > 1 else []),
                  layout=replace(FSDP.layout, name="toy", cp=False, ep=False))
    monkeypatch.setitem(STACKS, "toy", toy)
    # its rank layout is a field of the entry: the planner, the runners and the emitters read it by name
    cp2 = ParallelConfig(tp=1, pp=1, dp=2, mbs=1, global_batch=8, cp=2)
    assert stack_layout("toy+compile") is toy.layout and toy.refusals(cp2) == ["stack_layout"]
    assert rank_layout(replace(cp2, cp=1), "toy").names == ("pp", "dp_replicate", "dp_shard", "tp")
    model, training = ModelSpec.preset("tiny-llama"), TrainingSpec(global_batch=8, seq_len=64)
    pp2 = ParallelConfig(tp=1, pp=2, dp=1, mbs=1, global_batch=8)
    assert candidate_refusals(model, training, pp2, "cpu", None, toy) == refused
    assert refusals_for(model, training, replace(pp2, pp=1, dp=2), "cpu", stack="toy") == []
    kind = job_kind("toy", None)
    assert isinstance(kind, RunnerKind) and kind.runner_stack == "toy" and not traceable(toy)
    launch = RunnerTrial(TrialSpec(model, training, replace(pp2, pp=1, dp=2), stack="toy")).launch(None)  # type: ignore[arg-type]
    assert launch.argv[1:] == ["-m", "workers.rank.toy", "--candidate", "candidate.json"]
    assert list(launch.files) == ["candidate.json"] and not runs_deepspeed(None, "toy")
    trainer = ScriptSpec(argv=("python", "train.py"), kind="hf-trainer")
    assert bind_stack(trainer, toy).fsdp and not bind_stack(trainer, replace(HF_DEEPSPEED, name="toy2")).fsdp
