"""`pipette plan` and `pipette tune` say first which stack priced them and how it was chosen
(issue 45, "say which stack priced it"); a script's kind picks its stack."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CPU4 = str(ROOT / "examples" / "clusters" / "cpu-4.yaml")
TINY = ("--model", "tiny-llama", "--cluster", CPU4, "--global-batch", "16", "--seq-len", "128", "--no-files")


def pipette(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "cli", *args], capture_output=True, text=True, cwd=cwd or ROOT,
                          timeout=60)


def test_plan_says_the_default_stack_first_and_how_to_choose_another() -> None:
    r = pipette("plan", *TINY, "--top", "2")
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.splitlines()[:2]
    assert first.startswith("priced by pipette (") and first.endswith("the default"), first
    assert "--stack hf-deepspeed | megatron | nanotron | fsdp" in second, second


def test_plan_json_carries_the_lines_of_the_stack_named() -> None:
    r = pipette("plan", *TINY, "--stack", "fsdp", "--json")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert len(data["pricing"]) == 1 and data["pricing"][0].startswith("priced by fsdp (")
    assert data["pricing"][0].endswith("as named") and data["stack"]["name"] == "fsdp"


def test_plan_refuses_an_unknown_stack_naming_the_flag() -> None:
    r = pipette("plan", *TINY, "--stack", "tensorflow")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("pipette: error: --stack") and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_tune_says_the_stack_its_script_kind_picked_before_planning(tmp_path: Path) -> None:
    """A torchtitan script is priced by fsdp, said first; the job fits nowhere, so it stops after
    planning (a cluster file: no Ray, no trial)."""
    script = tmp_path / "train.py"
    script.write_text("import sys\n")
    r = pipette("tune", "--home", str(tmp_path / "home"), "--cluster", CPU4, "--model", "llama3-70b",
                "--global-batch", "8", "--seq-len", "4096", "--script-kind", "torchtitan",
                "--script", "python", str(script), cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.splitlines()
    assert lines[0] == ("priced by fsdp (PyTorch FSDP/FSDP2: torchtitan, Accelerate FSDP, llm-foundry), "
                        "from the script kind torchtitan"), lines
    assert lines[1].startswith("planning llama3-70b") and lines[1].endswith("stack fsdp ..."), lines
    assert lines[-1].startswith("pipette: error: --cluster: nothing fits"), lines


@pytest.mark.parametrize(("words", "stack", "how"), [
    (["--script-kind", "hf-trainer", "--script", "python", "train.py"], "hf-deepspeed", "script kind hf-trainer"),
    (["--script-kind", "accelerate-fsdp", "--script", "python", "train.py"], "fsdp", "script kind accelerate-fsdp"),
    (["--script", "python", "train.py", "--args", "out/megatron_args.txt"], "megatron",
     "launch file megatron_args.txt"),
    (["--stack", "hf-deepspeed", "--script", "python", "train.py", "out/megatron_args.txt"], "hf-deepspeed", "named"),
    ([], "pipette", "default"),
])
def test_tune_takes_the_stack_its_input_names(words: list[str], stack: str, how: str) -> None:
    """The flags as the command line parses them, through the registry that picks the trial kind."""
    from cli import _parser
    from cli.tune import _script, stack_choice
    from pipette.registry import job_kind

    args = _parser().parse_args(["tune", *words])
    script = _script(args)
    choice = stack_choice(args, script)
    assert (choice.stack, choice.how) == (stack, how)
    assert job_kind(choice.stack, script, field="--stack").stacks[0].name == stack
    if how == "named":  # the launch file's framework is said, not obeyed
        assert choice.hinted == "megatron"


def test_plan_trace_prints_the_live_bytes_of_the_top_fsdp_candidate_and_refuses_others() -> None:
    """`plan --trace 1` (issue 46): the fsdp stack's best traced on 4 fake ranks, said to be live
    bytes and not the reserve; a candidate of another stack says in one line it cannot be traced."""
    r = pipette("plan", *TINY, "--top", "2", "--stack", "fsdp", "--trace", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("traced memory of the top 1:"))
    assert "live tensor bytes of this code" in lines[at] and "not the allocator's reserve" in lines[at]
    assert lines[at + 1].startswith("  #1 ") and "(fsdp): estimated live" in lines[at + 1], lines[at + 1]
    assert lines[at + 2].startswith("    rank 0 of 4 (stage 0): live peak ") and "optimizer" in lines[at + 2]
    r = pipette("plan", *TINY, "--top", "1", "--trace", "1", "--json")
    assert r.returncode == 0, r.stderr
    (entry,) = json.loads(r.stdout)["traces"]
    assert entry["stack"] == "pipette" and "only the fsdp stack's runner can be traced" in entry["not_traced"]
    r = pipette("plan", *TINY, "--trace", "-1")
    assert r.returncode == 1 and r.stderr.startswith("pipette: error: --trace: is -1"), r.stderr
