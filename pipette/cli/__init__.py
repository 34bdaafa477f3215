"""``pipette``: the command line.

The one edge module that may reach workers/ and service/, always lazily inside the command
that needs them, so ``pipette plan`` runs with the core alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipette.cli import client, tune
from pipette.cli.signals import Terminated, exit_code, terminate_like_interrupt
from pipette.errors import PipetteError, SpecError

EXIT_OK = 0
EXIT_ERROR = 1  # a PipetteError: bad input or nothing feasible
EXIT_USAGE = 2  # argparse's own code for a bad command line

GiB = 1024**3

PLAN_EXAMPLES = """\
examples:
  pipette plan --model llama2-7b --cluster examples/clusters/a100-2x8.yaml \\
      --global-batch 64 --seq-len 4096 --method lora
  pipette plan --model path/to/config.json --cluster examples/clusters/h100-4x8-slow-links.yaml \\
      --recipe examples/recipes/llama2-70b-lora.yaml --top 5 --out plan-out
  pipette plan --model tiny-llama --cluster examples/clusters/cpu-4.yaml --global-batch 16 \\
      --seq-len 128 --json
"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    terminate_like_interrupt()  # SIGTERM says what it stopped and exits 143, not silently
    try:
        code: int = args.func(args)
        return code
    except PipetteError as e:
        print(f"pipette: error: {as_flags(e) if getattr(args, 'recipe_flags', False) else e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt as e:
        print("pipette: terminated (SIGTERM)" if isinstance(e, Terminated) else "pipette: interrupted",
              file=sys.stderr)
        return exit_code(e)
    except BrokenPipeError:  # `pipette plan | head`: the reader left, nothing to say
        sys.stderr.close()
        return EXIT_OK


#: the recipe flag that sets each training field (plan and tune)
RECIPE_FLAGS = {
    "training.global_batch": ("--global-batch", "N"), "training.seq_len": ("--seq-len", "N"),
    "training.dtype": ("--dtype", "bf16"), "training.optimizer": ("--optimizer", "adamw"),
    "training.method": ("--method", "lora"), "training.lora.rank": ("--lora-rank", "16"),
    "training.lora.alpha": ("--lora-alpha", "32"), "training.lora.targets": ("--lora-targets", "q_proj,v_proj"),
    "training.recompute": ("--recompute", "none,full"), "training.zero_stages": ("--zero", "0,1"),
    "training.schedules": ("--schedules", "1f1b"), "training.micro_batches": ("--micro-batches", "1,2,4"),
    "cluster": ("--cluster", "FILE"), "model": ("--model", "NAME"), "recipe": ("--recipe", "FILE"),
    "data": ("--data", "FILE"), "checkpoint": ("--checkpoint", "DIR"), "stack": ("--stack", "megatron"),
}


def as_flags(e: PipetteError) -> PipetteError:
    """A recipe error named by the flag that sets the field (``--global-batch``, not
    ``training.global_batch``); a missing one says which flag gives it."""
    flag = RECIPE_FLAGS.get(e.field or "")
    if flag is None:
        return e
    name, example = flag
    fix = e.fix
    if e.message == "is required":
        fix = f"give {name} {example}, or {(e.field or '').split('.', 1)[1]} in a --recipe file"
    return type(e)(e.message, field=name, fix=fix) if type(e) in (PipetteError, SpecError) else \
        PipetteError(e.message, field=name, fix=fix)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipette",
        description="Find the fastest parallel configuration that fits, for LLM training.",
    )
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    plan = sub.add_parser(
        "plan",
        help="rank every memory-feasible configuration by predicted step time (offline)",
        description="Enumerate, estimate memory and step time, drop what does not fit, "
        "optimise placement, and write the launch files of the best candidate.",
        epilog=PLAN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("--model", required=True, help="a preset name or a Hugging Face config.json path")
    plan.add_argument("--cluster", required=True, help="a cluster file (YAML or JSON)")
    add_recipe_flags(plan)
    plan.add_argument("--margin", type=float,
                      help="device memory to keep free, as a fraction of the predicted peak (default 0: "
                           "the chance to fit already prices the estimator's error)")
    plan.add_argument("--top", type=int, default=10, help="how many candidates to show (default 10)")
    plan.add_argument("--out", default="pipette-plan", help="where to write the best candidate's launch files")
    plan.add_argument("--no-files", action="store_true", help="do not write launch files")
    plan.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    plan.set_defaults(func=_cmd_plan)
    tune.add_parser(sub, lambda p: add_recipe_flags(p, TUNE_RECIPE_DEFAULTS))
    client.add_parsers(sub)  # the service's client: serve, cluster, submit, jobs, watch, ...
    return parser


#: What ``tune`` takes where neither a --recipe nor a flag says (``tune._with_defaults``); ``plan``
#: has no such defaults: its help says "required" where tune's gives the default.
TUNE_RECIPE_DEFAULTS = {
    "global_batch": "default 16 without --recipe", "seq_len": "default 128 without --recipe",
    "dtype": "default: the recipe's, else bf16; fp32 on the embedded CPU cluster (no --cluster)",
    "method": "default: the recipe's, else lora with --lora-rank 8 --lora-alpha 16",
}


def add_recipe_flags(p: argparse.ArgumentParser, defaults: dict[str, str] | None = None) -> None:
    """The training recipe's flags (``plan`` and ``tune``); they override ``--recipe``. Errors of
    these commands name the flag (``as_flags``). ``defaults``: the command's own default per
    flag, said in its help instead of "required"."""
    said = defaults or {}
    p.set_defaults(recipe_flags=True)
    p.add_argument("--recipe", help="a training recipe file (YAML or JSON); flags override it "
                   "(default: none, the flags alone)")
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step ("
                   + said.get("global_batch", "required, here or in --recipe") + ")")
    p.add_argument("--seq-len", type=int, help="tokens per sequence, at most the model's positions ("
                   + said.get("seq_len", "required, here or in --recipe") + ")")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"],
                   help="training precision (" + said.get("dtype", "default: the recipe's, else bf16") + ")")
    p.add_argument("--optimizer", choices=["adamw", "adam", "sgd"], help="default: the recipe's, else adamw")
    p.add_argument("--method", choices=["full", "lora"],
                   help="fine-tuning method (" + said.get("method", "default: the recipe's, else full") + ")")
    p.add_argument("--lora-rank", type=int, help="LoRA rank (default: the recipe's, else 16)")
    p.add_argument("--lora-alpha", type=float, help="LoRA alpha (default: the recipe's, else 32)")
    p.add_argument("--lora-targets", help="comma-separated module names (q_proj,v_proj,...; default: the recipe's, "
                   "else q_proj,k_proj,v_proj,o_proj)")
    p.add_argument("--recompute", help="allowed modes, comma-separated: none,selective,full (default: all)")
    p.add_argument("--zero", help="allowed ZeRO stages, comma-separated: 0,1,2,3 (default: all)")
    p.add_argument("--schedules", help="allowed pipeline schedules: 1f1b,interleaved (default: all)")
    p.add_argument("--micro-batches", help="allowed micro-batch sizes, comma-separated (default: every power of "
                   "two up to the batch per replica)")
    p.add_argument("--stack", help="the software that runs the job: pipette (default), hf-deepspeed, megatron, "
                   "fsdp; an option with +: fsdp+compile, megatron+fp8 (docs/stacks.md)")


# ---- pipette plan -----------------------------------------------------------------

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
        "optimizer": args.optimizer, "method": args.method,
    }
    data.update({k: v for k, v in flags.items() if v is not None})
    for key, raw, kind in (
        ("recompute", args.recompute, str), ("zero_stages", args.zero, int),
        ("schedules", args.schedules, str), ("micro_batches", args.micro_batches, int),
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


def _cmd_plan(args: argparse.Namespace) -> int:
    from pipette.clusterfile import load_cluster
    from pipette.emit import launch_command, write_launch_files
    from pipette.fits import memory_headroom
    from pipette.plan import DEFAULT_MARGIN, make_plan
    from pipette.stacks import get_stack

    # Every input is checked, cheapest first, and the first real error is the one reported.
    if args.top < 1:
        raise SpecError(f"is {args.top}", field="--top", fix="show at least 1 candidate")
    margin = DEFAULT_MARGIN if args.margin is None else args.margin
    if not 0 <= margin < 1:
        raise SpecError(f"is {margin}", field="--margin", fix="give a fraction between 0 and 1, e.g. 0.05")
    stack = get_stack(args.stack, field="--stack")
    cluster = load_cluster(args.cluster)
    model = load_model(args.model)
    training = load_recipe(args.recipe, args)
    start = time.perf_counter()
    plan = make_plan(model, training, cluster, margin=margin, stack=stack)
    elapsed = time.perf_counter() - start
    files: dict[str, str] = {}
    if not args.no_files:
        try:
            written = write_launch_files(
                args.out, model, training, plan.best.config, cluster, stack=stack,
                extra={"predicted": plan.best.to_dict(),
                       "memory_headroom": memory_headroom(plan.best.memory, plan.fits_prior or stack.fits_prior(
                           plan.cluster.device_spec.kind))},
            )
        except OSError as e:
            raise SpecError(
                f"cannot write {args.out!r} ({e.strerror})", field="--out", fix="give a writable folder"
            ) from None
        files = {k: str(v) for k, v in written.items()}
    if args.json:
        out = plan.to_dict(top=args.top)
        out["planning_seconds"] = elapsed
        out["files"] = files
        # a stack Pipette writes no launcher for (megatron, fsdp) has no launch command
        out["launch_command"] = launch_command(plan.best.config, cluster, args.out) \
            if "launch.sh" in stack.launch_files else None
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return EXIT_OK
    _print_plan(plan, args.top, elapsed)
    if files:
        print(f"\nlaunch files for #1 in {args.out}/: {', '.join(sorted(files))}")
        if "launch.sh" in files:
            print(f"launch: (cd {args.out} && ./launch.sh)")
        else:
            print(f"launch: with {stack.frameworks}, from the candidate in {args.out}/candidate.json "
                  "(Pipette writes no launcher for this stack yet)")
    return EXIT_OK


def fits_sentence(planned: Any, prior: Any) -> str:
    """How close to the memory limit a candidate runs, in words: its chance to fit and the
    headroom to expect (what a longer sequence or a larger micro-batch would eat)."""
    headroom = prior.headroom_bytes(planned.memory)
    capacity = planned.memory.capacity_bytes
    room = (f"{headroom / GiB:.1f} GiB ({headroom / capacity:.0%}) expected to stay free" if headroom >= 0 else
            f"expected {-headroom / GiB:.1f} GiB ({-headroom / capacity:.0%}) short")
    sure = "sure to fit" if planned.sure_to_fit else "not sure to fit"
    return f"chance to fit: {_chance(planned.chance_to_fit)} ({sure}); {room} of {capacity / GiB:.1f} GiB"


def _chance(p: float) -> str:
    """A chance to fit as shown: '>99%' rather than a rounded 100% that is not certain."""
    if p >= 0.995:
        return ">99%"
    return f"{p:.0%}"


def _print_plan(plan: Any, top: int, elapsed: float) -> None:
    from pipette.estimates import MEMORY_PARTS, TIME_PARTS
    from pipette.plan import DROP_REASONS
    from pipette.stacks import OPTION_NOT_MODELLED

    c = plan.cluster
    print(
        f"{plan.model.name} ({plan.model.total_params() / 1e9:.2f}B params), "
        f"{plan.training.method}, {plan.training.dtype}, global batch {plan.training.global_batch} "
        f"x {plan.training.seq_len} tokens"
    )
    print(f"cluster {c.name}: {len(c.nodes)} nodes, {c.world} x {c.device_spec.name}")
    print(f"stack {plan.stack.key}: {plan.stack.frameworks}"
          + (f" ({', '.join(plan.stack.options)}: {OPTION_NOT_MODELLED})" if plan.stack.options else ""))
    dropped = sum(plan.dropped.values())
    sure = sum(p.sure_to_fit for p in plan.ranked)
    kept_free = f", {plan.margin:.0%} of memory kept free" if plan.margin else ""
    print(
        f"{plan.enumerated} candidates, {len(plan.ranked)} may fit ({sure} sure to fit), {dropped} dropped "
        f"(planned in {elapsed:.2f} s{kept_free})"
    )
    if plan.fits_prior is not None:
        print(f"fit: the chance to fit in memory, from the estimator's measured error ({plan.fits_prior.name}: "
              f"{plan.fits_prior.source}); ranked by the step time to expect from trying each\n")
    header = f"{'#':>3} {'tp':>3} {'pp':>3} {'dp':>4} {'mbs':>3} {'zero':>4} {'recompute':>9} {'schedule':>8} " \
             f"{'step s':>9} {'tokens/s':>11} {'MFU':>6} {'HFU':>6} {'peak GiB':>15} {'fit':>5}"
    print(header)
    for i, p in enumerate(plan.ranked[:top], 1):
        cfg = p.config
        sched = cfg.schedule if cfg.schedule == "1f1b" else f"int-v{cfg.virtual_stages}"
        mem = f"{p.memory.peak_bytes / GiB:.1f}/{p.memory.capacity_bytes / GiB:.0f}"
        print(
            f"{i:>3} {cfg.tp:>3} {cfg.pp:>3} {cfg.dp:>4} {cfg.mbs:>3} {cfg.zero_stage:>4} "
            f"{cfg.recompute:>9} {sched:>8} {p.perf.step_time:>9.3f} {p.perf.tokens_per_s:>11,.0f} "
            f"{p.perf.mfu:>6.1%} {p.perf.hfu:>6.1%} {mem:>15} {_chance(p.chance_to_fit):>5}"
        )
    print("\ndropped:" if dropped else "\ndropped: none")
    for code, count in plan.dropped.most_common():
        if count:
            print(f"  {count:>6}  {DROP_REASONS.get(code, code)}")
    best = plan.best
    print(f"\nbest: {best.config.label}  (placement: {best.placement_method}; "
          f"default placement {best.default_step_time:.3f} s -> {best.perf.step_time:.3f} s)")
    print("  time per step:")
    for part in TIME_PARTS:
        value = best.perf.breakdown.get(part, 0.0)
        if value > 0:
            print(f"    {part:<15} {value:>9.4f} s  {value / best.perf.step_time:>6.1%}")
    print(f"  memory on the heaviest rank (stage {best.memory.stage}):")
    for part in MEMORY_PARTS:
        value = best.memory.breakdown.get(part, 0)
        if value > 0:
            print(f"    {part:<15} {value / GiB:>9.2f} GiB")
    print(f"    {'total':<15} {best.memory.peak_bytes / GiB:>9.2f} GiB of {best.memory.capacity_bytes / GiB:.1f} GiB")
    if plan.fits_prior is not None:
        print(f"  {fits_sentence(best, plan.fits_prior)}")
        if not best.sure_to_fit:
            sure = next((p for p in plan.ranked if p.sure_to_fit), None)
            if sure is not None:
                print(f"  if it runs out of memory: {sure.config.label}, sure to fit, predicted "
                      f"{sure.perf.step_time:.3f} s a step (`pipette tune` tries both)")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
