"""The flags ``plan``, ``tune`` and ``submit`` share, and reading what they name.

The recipe's flags (``plan`` and ``tune``) override a ``--recipe`` file; the tuning options'
flags are generated from ``pipette.options`` (the API's budget is generated from the same
records, so a flag and its API field never disagree). A bad value is one line naming the
flag and the fix (a ``SpecError``), the wrong type included.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from pipette.errors import PipetteError, SpecError
from pipette.options import BY_NAME, Option, Scope, Value, describe, options_for
from pipette.training import DTYPES

#: the recipe flag that sets each training field (plan and tune)
RECIPE_FLAGS = {
    "training.global_batch": ("--global-batch", "N"), "training.seq_len": ("--seq-len", "N"),
    "training.dtype": ("--dtype", "bf16"), "training.optimizer": ("--optimizer", "adamw"),
    "training.method": ("--method", "lora"), "training.lora.rank": ("--lora-rank", "16"),
    "training.lora.alpha": ("--lora-alpha", "32"), "training.lora.targets": ("--lora-targets", "q_proj,v_proj"),
    "training.recompute": ("--recompute", "none,full"), "training.zero_stages": ("--zero", "0,1"),
    "training.schedules": ("--schedules", "1f1b"), "training.micro_batches": ("--micro-batches", "1,2,4"),
    "training.document_len": ("--document-len", "512"), "training.moe_routing": ("--moe-routing", "dropless,1.0"),
    "cluster": ("--cluster", "FILE"), "model": ("--model", "NAME"), "recipe": ("--recipe", "FILE"),
    "data": ("--data", "FILE"), "checkpoint": ("--checkpoint", "DIR"), "stack": ("--stack", "megatron"),
}
#: how each option is named on the command line, for the options' help (``{max_trials}``)
FLAG_NAMES = {o.name: o.cli_flag for o in BY_NAME.values()}


def as_flags(e: PipetteError) -> PipetteError:
    """A recipe or option error named by the flag that sets the field (``--global-batch``, not
    ``training.global_batch``; ``--reserve``, not ``budget.reserve``); a missing one says which
    flag gives it."""
    option = BY_NAME.get((e.field or "").removeprefix("budget."))
    flag = (option.cli_flag, "") if option is not None and (e.field or "").startswith("budget.") \
        else RECIPE_FLAGS.get(e.field or "")
    if flag is None:
        return e
    name, example = flag
    fix = e.fix
    if e.message == "is required":
        fix = f"give {name} {example}, or {(e.field or '').split('.', 1)[1]} in a --recipe file"
    return type(e)(e.message, field=name, fix=fix) if type(e) in (PipetteError, SpecError) else \
        PipetteError(e.message, field=name, fix=fix)


# ---- the tuning options -------------------------------------------------------------

def add_option_flags(p: argparse.ArgumentParser, scope: Scope, *, overriding: str | None = None) -> None:
    """The flags of the options of ``scope`` (``pipette.options``). ``overriding``: they
    override that (a job file) and default to it, instead of to the options' defaults."""
    group = p.add_argument_group("tuning options" if scope == "tune" else "planning options")
    for option in options_for(scope):
        text, default = describe(option, FLAG_NAMES)
        if overriding is not None:
            default = f"default: {overriding}'s, else {default.removeprefix('default').lstrip(': ')}"
        if option.kind is bool:  # --prune and --no-prune (BooleanOptionalAction's help differs by version)
            value = None if overriding else option.default
            group.add_argument(option.cli_flag, dest=option.name, action="store_const", const=True, default=value,
                               help=f"{text} ({default})")
            group.add_argument("--no-" + option.cli_flag[2:], dest=option.name, action="store_const", const=False,
                               default=value, help=f"the opposite of {option.cli_flag}")
            continue
        # Read as text and converted by the option itself, so a wrong type is one line too.
        group.add_argument(option.cli_flag, dest=option.name, metavar=_metavar(option),
                           default=None if overriding else option.default, help=f"{text} ({default})")


def option_values(args: argparse.Namespace, scope: Scope, *, given_only: bool = False) -> dict[str, Value]:
    """The options of ``scope`` from the parsed flags, checked; ``given_only``: only those given."""
    out: dict[str, Value] = {}
    for option in options_for(scope):
        raw = getattr(args, option.name)
        if given_only and raw is None:
            continue
        out[option.name] = option.parse(raw, option.cli_flag) if isinstance(raw, str) else \
            option.check(raw, option.cli_flag)
    return out


def _metavar(option: Option) -> str:
    if option.name.endswith("_s"):
        return "SECONDS"
    return "N" if option.kind is int else "FRACTION"


# ---- the recipe ---------------------------------------------------------------------

def spec_default(cls: type, name: str) -> Any:
    """The default of field ``name`` of the dataclass ``cls`` (``TrainingSpec``, ``LoraSpec``): what
    the help texts say, read from where it is defined."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def recipe_default(name: str) -> str:
    """A recipe flag's default where no ``--recipe`` gives it, in words, from ``TrainingSpec`` and
    ``LoraSpec`` (the one place it is defined)."""
    from pipette.training import LoraSpec, TrainingSpec

    if name.startswith("lora_"):
        value = spec_default(LoraSpec, name.removeprefix("lora_"))
        value = ",".join(value) if isinstance(value, tuple) else f"{value:g}"
    else:
        value = spec_default(TrainingSpec, name)
    return f"default: the recipe's, else {value}"


def stack_help() -> str:
    """``--stack``'s help: the stacks by name from their registry, the default marked, and the
    forms a value takes (an option with ``+``, several with ``,``)."""
    from pipette.stacks import STACKS, get_stack

    default = get_stack(None).name
    names = ", ".join(f"{n} (default)" if n == default else n for n in STACKS)
    return (f"the software that runs the job: {names}; an option with +: fsdp+compile, megatron+fp8; several, "
            "comma-separated, to rank their candidates side by side: pipette,fsdp (docs/stacks.md)")


def add_recipe_flags(p: argparse.ArgumentParser, defaults: dict[str, str] | None = None) -> None:
    """The training recipe's flags (``plan`` and ``tune``); they override ``--recipe``. Errors of
    these commands name the flag (``as_flags``). ``defaults``: the command's own default per
    flag, said in its help instead of "required" or the recipe's defaults (``recipe_default``)."""
    said = defaults or {}
    p.set_defaults(recipe_flags=True)
    p.add_argument("--recipe", help="a training recipe file (YAML or JSON); flags override it "
                   "(default: none, the flags alone)")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step ("
                   + said.get("global_batch", "required, here or in --recipe") + ")")
    p.add_argument("--seq-len", type=int, help="tokens per sequence, at most the model's positions ("
                   + said.get("seq_len", "required, here or in --recipe") + ")")
    p.add_argument("--dtype", choices=list(DTYPES),
                   help="training precision: bf16, fp16 (mixed), fp32, or tf32 (fp32 with TF32 tensor-core "
                        "matmuls) (" + said.get("dtype", recipe_default("dtype")) + ")")
    p.add_argument("--optimizer", choices=["adamw", "adam", "sgd"], help=recipe_default("optimizer"))
    p.add_argument("--method", choices=["full", "lora"],
                   help="fine-tuning method (" + said.get("method", recipe_default("method")) + ")")
    p.add_argument("--lora-rank", type=int, help="LoRA rank (" + said.get("lora_rank", recipe_default("lora_rank"))
                   + ")")
    p.add_argument("--lora-alpha", type=float, help="LoRA alpha (" + said.get("lora_alpha",
                   recipe_default("lora_alpha")) + ")")
    p.add_argument("--lora-targets", help="comma-separated module names (q_proj,v_proj,...; "
                   + recipe_default("lora_targets") + ")")
    p.add_argument("--recompute", help="allowed modes, comma-separated: none,selective,full (default: all)")
    p.add_argument("--zero", help="allowed ZeRO stages, comma-separated: 0,1,2,3 (default: all)")
    p.add_argument("--schedules", help="allowed pipeline schedules: 1f1b,interleaved (default: all)")
    p.add_argument("--micro-batches", help="allowed micro-batch sizes, comma-separated (default: every power of "
                   "two up to the batch per replica)")
    p.add_argument("--document-len", type=int, help="packed sequences: the documents packed into each sequence "
                   "hold about this many tokens, and attend within themselves where the stack's attention keeps to "
                   "documents (megatron's packed sequences) (default: one document a sequence)")
    p.add_argument("--moe-routing", help="an MoE model's routings the search may plan, comma-separated: dropless "
                   "and capacity factors (1.0, 1.25), which drop tokens past an expert's capacity and so change "
                   "what the model learns (default: the model's own routing, dropless unless it sets one)")
    p.add_argument("--stack", help=stack_help())


def load_model(value: str) -> Any:
    from pipette.model import MODEL_PRESETS, ModelSpec

    if value.lower() in MODEL_PRESETS:
        return ModelSpec.preset(value)
    if value.endswith(".json") or Path(value).exists():
        return ModelSpec.from_hf_config(value)  # a config.json, or the model folder holding it
    return ModelSpec.preset(value)  # raises UnknownPresetError with the list of presets


def load_recipe(path: str | None, args: argparse.Namespace) -> Any:
    from pipette.training import TrainingSpec

    data: dict[str, Any] = {}
    if path:
        from pipette.textfile import load_data_file

        loaded = load_data_file(path, "recipe", "recipe file", "fix its syntax")
        if not isinstance(loaded, dict):
            raise SpecError(f"{path} does not hold a mapping", field="recipe", fix="write key: value pairs")
        data.update(loaded)
    flags = {
        "global_batch": args.global_batch, "seq_len": args.seq_len, "dtype": args.dtype,
        "optimizer": args.optimizer, "method": args.method, "document_len": getattr(args, "document_len", None),
    }
    data.update({k: v for k, v in flags.items() if v is not None})
    for key, raw, kind in (
        ("recompute", args.recompute, str), ("zero_stages", args.zero, int),
        ("schedules", args.schedules, str), ("micro_batches", args.micro_batches, int),
        ("moe_routing", getattr(args, "moe_routing", None), str),
    ):
        if raw:
            data[key] = _csv(raw, kind, "--" + key.replace("_", "-"))
    lora = dict(data.get("lora") or {})
    if args.lora_rank is not None:
        lora["rank"] = args.lora_rank
    if args.lora_alpha is not None:
        lora["alpha"] = args.lora_alpha
    if args.lora_targets:
        lora["targets"] = _csv(args.lora_targets, str, "--lora-targets")
    if lora:
        data["lora"] = lora
        data.setdefault("method", "lora")
    return TrainingSpec.from_dict(data)


def _csv(raw: str, kind: type, flag: str) -> list[Any]:
    try:
        return [kind(x.strip()) for x in raw.split(",") if x.strip()]
    except ValueError:
        raise SpecError(f"cannot read {raw!r}", field=flag, fix="give comma-separated values, e.g. 0,1") from None
