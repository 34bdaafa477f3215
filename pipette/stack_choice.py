"""Which stack prices a plan or a tuning job, and how it was chosen, said before anything else (issue 45).

A plan priced with another framework's constants is wrong by 35% or more (Megatron's runs priced
as Pipette's runner's), so it is never silent: the first lines say which stack priced it, how it was
chosen, and how to choose another. Where the input names the framework (a script kind, launch
files a framework reads), that stack is used unless one is named.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import PurePath

# the stack a script kind runs (``pipette tune --script-kind``) and the launch files only one framework
# reads (Megatron-LM's arguments, nanotron's config, torchtitan's job config): each stack's entry says
from pipette.stacks import DEFAULT_STACK, FRAMEWORK_FILES, SCRIPT_KIND_STACKS, STACK_SEPARATOR, STACKS, get_stacks


@dataclass(frozen=True)
class StackChoice:
    """The stack(s) to price with (``pipette,fsdp`` form) and how they were chosen."""

    stack: str
    #: "named", "script kind <kind>", "launch file <name>" or "default"
    how: str
    #: a stack the input names that differs from the one named (said, never overridden)
    hinted: str | None = None


def _hint(script_kind: str | None, files: Iterable[str]) -> tuple[str, str] | None:
    if script_kind in SCRIPT_KIND_STACKS:
        return SCRIPT_KIND_STACKS[script_kind], f"script kind {script_kind}"
    for f in files:
        name = PurePath(f).name
        if name in FRAMEWORK_FILES:
            return FRAMEWORK_FILES[name], f"launch file {name}"
    return None


def choose_stack(named: str | None, *, script_kind: str | None = None, files: Iterable[str] = ()) -> StackChoice:
    """The stack named, else the one the input names (script kind, then launch files), else the default."""
    hint = _hint(script_kind, files)
    if named:
        keys = [s.name for s in get_stacks(named)]
        other = hint[0] if hint is not None and hint[0] not in keys else None
        return StackChoice(named, "named", other)
    if hint is not None:
        return StackChoice(hint[0], hint[1])
    return StackChoice(DEFAULT_STACK, "default")


def pricing_lines(choice: StackChoice) -> list[str]:
    """The first lines of a plan or a tune: which stack priced it, how it was chosen, how to choose."""
    stacks = get_stacks(choice.stack)
    who = "; ".join(f"{s.key} ({s.frameworks})" for s in stacks)
    how = {"named": "as named", "default": "the default"}.get(choice.how, f"from the {choice.how}")
    lines = [f"priced by {who}, {how}"]
    others = " | ".join(n for n in STACKS if n not in {s.name for s in stacks})
    if choice.how == "default":
        lines.append(f"these are Pipette's own runner's prices; a job that runs another framework is priced by "
                     f"its stack: --stack {others} (or stack: in a job file)")
    lines += [f"{s.name}: {s.bare_note}" for s in stacks if s.bare_note and not s.options]
    if choice.hinted is not None:
        lines.append(f"note: the input looks like {choice.hinted} ({STACKS[choice.hinted].frameworks}), priced as "
                     f"{STACK_SEPARATOR.join(s.key for s in stacks)} because it was named: --stack {choice.hinted} "
                     f"to price it as that")
    return lines


__all__ = ["FRAMEWORK_FILES", "SCRIPT_KIND_STACKS", "StackChoice", "choose_stack", "pricing_lines"]
