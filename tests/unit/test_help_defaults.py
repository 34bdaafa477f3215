"""The command line's help names the defaults the commands really use (issue 43, item 17): `tune
--help` said LoRA rank 8 / alpha 16 under --method and 16 / 32 under --lora-rank and --lora-alpha,
and `tune --method lora` trained at 16 / 32 while `tune` alone trained at 8 / 16. The texts are
written from where the defaults are defined (``TUNE_DEFAULTS``, ``TrainingSpec``, ``LoraSpec``, the
stack registry); these tests read the help as a user does and check it against the recipe built."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from cli import _parser
from cli.inputs import load_recipe
from cli.tune import _with_defaults
from pipette.training import TrainingSpec

ROOT = Path(__file__).resolve().parents[2]


def _help(command: str) -> dict[str, str]:
    """Each flag's help text of ``command``, as ``--help`` prints it (joined onto one line)."""
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[command]
    return {flag: " ".join((action.help or "").split()) for action in parser._actions for flag in action.option_strings}


def _tune_recipe(*argv: str) -> TrainingSpec:
    args = _parser().parse_args(["tune", *argv])
    return load_recipe(args.recipe, _with_defaults(args))


def _said(text: str, case: str) -> float:
    """The number ``text`` gives for ``case`` ("without --recipe", or the recipe's "else N")."""
    pattern = r"default (\d+(?:\.\d+)?) without --recipe" if case == "without" else r"else (\d+(?:\.\d+)?)\)?$"
    found = re.search(pattern, text)
    assert found, (case, text)
    return float(found.group(1))


def test_tunes_lora_help_names_the_rank_and_alpha_it_trains_with(tmp_path: Path) -> None:
    said = _help("tune")
    rank, alpha = said["--lora-rank"], said["--lora-alpha"]
    for trained in (_tune_recipe(), _tune_recipe("--method", "lora")):  # LoRA by default, or asked for
        assert trained.method == "lora" and trained.lora is not None
        assert trained.lora.rank == _said(rank, "without") and trained.lora.alpha == _said(alpha, "without")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("global_batch: 8\nseq_len: 64\nmethod: lora\n")  # a recipe that gives no rank
    trained = _tune_recipe("--recipe", str(recipe))
    assert trained.lora is not None
    assert trained.lora.rank == _said(rank, "else") and trained.lora.alpha == _said(alpha, "else")
    # --method names no other numbers than the rank and alpha flags' own
    assert not re.search(r"\d", said["--method"]), said["--method"]
    assert _tune_recipe().global_batch == _said(said["--global-batch"], "without")
    assert _tune_recipe().seq_len == _said(said["--seq-len"], "without")
    assert _tune_recipe().dtype in said["--dtype"].split(" without --recipe")[0]


@pytest.mark.parametrize("command", ["plan", "tune"])
def test_the_stack_help_names_every_stack_and_the_comma_form(command: str) -> None:
    from pipette.stacks import STACKS

    text = _help(command)["--stack"]
    assert all(name in text for name in STACKS) and "pipette,fsdp" in text, text


def test_plans_recipe_help_says_the_recipes_own_defaults() -> None:
    said = _help("plan")
    spec = TrainingSpec(global_batch=8, seq_len=64, method="lora")
    assert spec.lora is not None
    assert _said(said["--lora-rank"], "else") == spec.lora.rank
    assert _said(said["--lora-alpha"], "else") == spec.lora.alpha
    assert said["--method"].endswith(f"else {TrainingSpec(global_batch=8, seq_len=64).method})")


def test_the_tuning_docs_synopsis_lists_every_script_kind() -> None:
    from pipette.script import KINDS

    synopsis = (ROOT / "docs" / "tuning.md").read_text().split("```")[1]
    kinds = re.search(r"--script-kind ([\w|-]+)", synopsis)
    assert kinds and set(kinds.group(1).split("|")) == set(KINDS), synopsis


def test_the_tuning_docs_synopsis_gives_the_options_defaults() -> None:
    """Each ``[--flag VALUE]`` of the synopsis whose option has a default (``pipette.options``) shows it."""
    from pipette.options import BY_NAME

    synopsis = (ROOT / "docs" / "tuning.md").read_text().split("```")[1]
    shown = dict(re.findall(r"\[(--[\w-]+) ([\d.]+)\]", synopsis))
    checked = 0
    for option in BY_NAME.values():
        if option.cli_flag in shown and option.default is not None and "tune" in option.scopes:
            assert float(shown[option.cli_flag]) == float(option.default), option.cli_flag
            checked += 1
    assert checked >= 8
