"""A plan or tune says first which stack priced it and how to choose (issue 45, "say which stack
priced it"); where the input names the framework, that stack is used."""

from __future__ import annotations

import pytest

from pipette.errors import SpecError
from pipette.stack_choice import choose_stack, pricing_lines
from pipette.stacks import STACKS


def test_the_default_stack_is_said_with_how_to_choose_another() -> None:
    choice = choose_stack(None)
    lines = pricing_lines(choice)
    assert choice.stack == "pipette" and lines[0].startswith("priced by pipette (")
    assert "the default" in lines[0] and "--stack hf-deepspeed | megatron | nanotron | fsdp" in lines[1]


@pytest.mark.parametrize(("kind", "files", "stack", "how"), [
    ("hf-trainer", (), "hf-deepspeed", "script kind hf-trainer"),
    ("torchtitan", (), "fsdp", "script kind torchtitan"),
    (None, ("out/megatron_args.txt", "out/hostfile"), "megatron", "launch file megatron_args.txt"),
    (None, ("nanotron.yaml",), "nanotron", "launch file nanotron.yaml"),
])
def test_the_input_names_the_framework(kind: str | None, files: tuple[str, ...], stack: str, how: str) -> None:
    choice = choose_stack(None, script_kind=kind, files=files)
    assert (choice.stack, choice.how) == (stack, how)
    lines = pricing_lines(choice)
    assert lines[0] == f"priced by {stack} (" + lines[0].split(" (", 1)[1] and lines[0].endswith(f"from the {how}")
    assert lines[1:] == ([f"megatron: {STACKS['megatron'].bare_note}"] if stack == "megatron" else [])


def test_bare_megatron_says_what_it_prices_and_how_to_price_transformer_engine() -> None:
    """``megatron`` alone is vTrain's unfused Megatron; a user of Megatron-Core with Transformer Engine (NeMo,
    Megatron-Bridge, Megatron-LM's default) is told the option that prices it; with an option, nothing."""
    bare = pricing_lines(choose_stack("megatron"))
    assert len(bare) == 2 and "unfused" in bare[1] and "--stack megatron+te" in bare[1]
    assert pricing_lines(choose_stack("megatron+te")) == ["priced by megatron+te (Megatron-LM, NeMo), as named"]
    assert len(pricing_lines(choose_stack("megatron,fsdp"))) == 2


def test_a_named_stack_wins_and_a_different_hint_is_said() -> None:
    choice = choose_stack("pipette", files=("megatron_args.txt",))
    lines = pricing_lines(choice)
    assert choice.stack == "pipette" and lines[0].endswith("as named")
    assert lines[1].startswith("note: the input looks like megatron") and "--stack megatron" in lines[1]
    assert len(pricing_lines(choose_stack("megatron+fp8", files=("megatron_args.txt",)))) == 1
    with pytest.raises(SpecError):
        choose_stack("tensorflow")
