"""``pipette plan``: what-if planning with no trials. Enumerate the candidates, estimate their
memory and step time, drop what does not fit, optimise placement, print the ranking and write
the best candidate's launch files."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from cli.inputs import add_option_flags, add_recipe_flags, load_model, load_recipe, option_values
from pipette.emit_frameworks import MEGATRON_ARGS, NANOTRON_CONFIG
from pipette.errors import SpecError
from pipette.space_moe import AUTOEP_STACKS

EXIT_OK = 0
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


def add_parser(sub: Any) -> None:
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
    add_option_flags(plan, "plan")
    plan.add_argument("--out", default="pipette-plan", help="where to write the best candidate's launch files")
    plan.add_argument("--no-files", action="store_true", help="do not write launch files")
    plan.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    plan.add_argument("--explain", action="store_true",
                      help="say term by term what one rank of the best candidate of each context-parallel degree "
                           "holds in memory (docs/context-parallel.md)")
    plan.add_argument("--trace", type=int, default=0, metavar="N",
                      help="trace one training step of each of the top N candidates of the fsdp stack on fake "
                           "devices at the real world size: the live bytes of its code by category (seconds to "
                           "minutes each, on the CPU; docs/tuning.md)")
    plan.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from pipette.clusterfile import load_cluster
    from pipette.plan import DEFAULT_MARGIN, make_plan
    from pipette.stack_choice import choose_stack, pricing_lines
    from pipette.stacks import get_stacks

    # Every input is checked, cheapest first, and the first real error is the one reported.
    options = option_values(args, "plan")
    if args.trace < 0:
        raise SpecError(f"is {args.trace}", field="--trace", fix="give how many top candidates to trace: 1 or more")
    top = int(options["top"] or 0)
    margin = DEFAULT_MARGIN if options["margin"] is None else float(options["margin"])
    get_stacks(args.stack, field="--stack")  # a stack that does not exist: refused naming the flag
    # Never another framework's prices silently: the stack and how it was chosen come first.
    choice = choose_stack(args.stack, files=[f for f in (args.model, args.recipe) if f])
    stacks = get_stacks(choice.stack, field="--stack")
    pricing = pricing_lines(choice)
    cluster = load_cluster(args.cluster)
    model = load_model(args.model)
    training = load_recipe(args.recipe, args)
    start = time.perf_counter()
    plan = make_plan(model, training, cluster, margin=margin, stack=stacks)
    elapsed = time.perf_counter() - start
    files = {} if args.no_files else _write_launch_files(args, plan)
    if args.json:
        json.dump(_plan_json(args, plan, pricing, top, elapsed, files), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return EXIT_OK
    print("\n".join(pricing))
    _print_plan(plan, top, elapsed)
    if files:
        _print_launch(args, plan, files)
    if args.explain:
        print_explain(plan)
    if args.trace:
        print_traces(plan, args.trace)
    return EXIT_OK


def _write_launch_files(args: argparse.Namespace, plan: Any) -> dict[str, str]:
    """The launch files of ``Plan.launch_pick`` (the fastest sure to fit: a launch cannot retry after
    running out of memory) in ``--out``, for the stack that runs it: name -> path."""
    from pipette.emit import write_launch_files
    from pipette.fits import memory_headroom

    pick = plan.launch_pick
    stack = plan.stack_of(pick.config)  # with several stacks: the one that runs it
    try:
        written = write_launch_files(
            args.out, plan.model, plan.training, pick.config, plan.cluster, stack=stack,
            extra={"predicted": pick.to_dict(),
                   "memory_headroom": memory_headroom(pick.memory, plan.fits_prior or stack.fits_prior(
                       plan.cluster.device_spec.kind))},
        )
    except OSError as e:
        raise SpecError(
            f"cannot write {args.out!r} ({e.strerror})", field="--out", fix="give a writable folder"
        ) from None
    return {k: str(v) for k, v in written.items()}


def _plan_json(
    args: argparse.Namespace, plan: Any, pricing: list[str], top: int, elapsed: float, files: dict[str, str]
) -> dict[str, Any]:
    """``--json``'s document: the pricing, the plan's top candidates, the launch pick and its command."""
    from pipette.emit import stack_launch_command

    pick = plan.launch_pick
    out = {"pricing": pricing, **plan.to_dict(top=top)}
    out["planning_seconds"] = elapsed
    out["files"] = files
    out["launch_pick"] = {"rank": plan.ranked.index(pick) + 1, "label": pick.config.label,
                          "chance_to_fit": pick.chance_to_fit, "sure_to_fit": pick.sure_to_fit}
    # a stack Pipette writes no launcher for (megatron, an option its runner does not run): None
    out["launch_command"] = stack_launch_command(pick.config, plan.cluster, plan.stack_of(pick.config), args.out)
    if args.trace:
        out["traces"] = [entry for entry, _ in traced(plan, args.trace)]
    return out


def _print_launch(args: argparse.Namespace, plan: Any, files: dict[str, str]) -> None:
    """Which candidate the launch files are for, the faster and riskier ones, and how to launch it."""
    from pipette.emit import launch_sh_lines

    pick = plan.launch_pick
    print(f"\nlaunch files for {pick_words(plan)} in {args.out}/: {', '.join(sorted(files))}")
    for line in riskier_lines(plan):
        print(f"  {line}")
    if "launch.sh" in files:
        print("\n".join(launch_sh_lines(args.out, pick.config, plan.cluster)))
    elif MEGATRON_ARGS in files:
        print(f"launch: your Megatron-LM job with the arguments in {args.out}/{MEGATRON_ARGS} "
              "(the parallel layout and batch; your model, data and optimizer arguments besides)")
    elif NANOTRON_CONFIG in files:
        print(f"launch: your nanotron job with the keys of {args.out}/{NANOTRON_CONFIG} merged into its config")
    else:
        print(f"launch: with {plan.stack_of(pick.config).frameworks}, from the candidate in {args.out}/candidate.json "
              "(Pipette writes no launcher for this stack yet)")


def print_explain(plan: Any) -> None:
    """The memory of the best-ranked candidate of each cp degree, term by term (``pipette.memory_cp.explain``)."""
    from pipette.memory_cp import explain

    print("\nmemory explained, the best-ranked candidate of each cp degree:")
    seen: set[int] = set()
    for p in plan.ranked:
        if p.config.cp in seen:
            continue
        seen.add(p.config.cp)
        cp_comm, repeat_kv = plan.stack_of(p.config).memory_options.cp_exchange(plan.cluster.device_spec.kind)
        print(f"{p.config.label} (#{plan.ranked.index(p) + 1}, {p.perf.step_time:.3f} s a step)")
        print("\n".join(explain(p.memory.breakdown, plan.model, plan.training, p.config, cp_comm, repeat_kv)))


def traced(plan: Any, n: int) -> list[tuple[dict[str, Any], list[Any]]]:
    """The top ``n`` candidates, each traced where the fsdp stack runs it (``workers.rank.fsdp_trace``:
    one step of the PyTorch-native runner's code on fake tensors at the real world size), with its
    JSON entry; a candidate of another stack, or one the runner cannot build, says why."""
    from pipette.errors import PipetteError
    from pipette.registry import traceable
    from workers.rank.fsdp_trace import trace_heaviest  # lazily: torch, and cli reaches workers only so
    from workers.spec import TrialSpec

    out: list[tuple[dict[str, Any], list[Any]]] = []
    for rank, p in enumerate(plan.ranked[:n], 1):
        stack = plan.stack_of(p.config)
        entry: dict[str, Any] = {"rank": rank, "label": p.config.label, "stack": stack.key,
                                 "estimated_live_bytes": p.memory.live_bytes}
        traces: list[Any] = []
        if not traceable(stack):
            entry["not_traced"] = f"a {stack.key} candidate: only the fsdp stack's runner can be traced"
        else:
            trial = TrialSpec(plan.model, plan.training, p.config, warmup_steps=1, min_steps=1, max_steps=1,
                              device_kind="cpu", stack=stack.name)
            try:
                traces = trace_heaviest(trial)
                entry["traces"] = [t.to_dict() for t in traces]
            except PipetteError as e:  # a layout the runner refuses: said on its line, the others still traced
                entry["not_traced"] = str(e)
        out.append((entry, traces))
    return out


def print_traces(plan: Any, n: int) -> None:
    """``--trace N``'s lines: per candidate its heaviest ranks' traced live bytes beside the estimate."""
    from workers.rank.fsdp_trace import describe

    print(f"\ntraced memory of the top {n}: the live tensor bytes of this code (Pipette's fsdp runner: what "
          "max_memory_allocated reports) at the candidate's real world size on fake devices, not the allocator's "
          "reserve nor the device's use")
    for entry, traces in traced(plan, n):
        head = f"  #{entry['rank']} {entry['label']} ({entry['stack']})"
        if "not_traced" in entry:
            print(f"{head}: cannot be traced: {entry['not_traced']}")
            continue
        live = entry["estimated_live_bytes"]
        unit, size = ("GiB", GiB) if live >= GiB else ("MiB", 1024**2)
        print(f"{head}: estimated live {live / size:.2f} {unit} on the heaviest rank")
        for trace in traces:
            print(f"    {describe(trace)}")


def pick_words(plan: Any) -> str:
    """Which candidate the launch files are for, and why (``Plan.launch_pick``)."""
    from pipette.fits import SURE_TO_FIT

    pick = plan.launch_pick
    rank = plan.ranked.index(pick) + 1
    if rank == 1 and (pick.sure_to_fit or plan.fits_prior is None):
        return "#1"
    if pick.sure_to_fit:
        return (f"#{rank} {pick.config.label}, the fastest sure to fit ({_chance(pick.chance_to_fit)} chance to fit; "
                f"sure means {SURE_TO_FIT:.0%} or more)")
    return (f"#{rank} {pick.config.label}, the likeliest to fit ({_chance(pick.chance_to_fit)}; none is sure to "
            f"fit, {SURE_TO_FIT:.0%} or more): a trial (`pipette tune`) tells whether it runs")


def riskier_lines(plan: Any) -> list[str]:
    """The faster candidates the launch files are not for: the best-ranked of them with its speed-up
    and its chance to fit, and how many more there are."""
    pick = plan.launch_pick
    faster = [p for p in plan.ranked if p.perf.step_time < pick.perf.step_time]
    if not faster:
        return []
    first = faster[0]
    gain = 1 - first.perf.step_time / pick.perf.step_time
    more = f" ({len(faster) - 1} more faster and riskier)" if len(faster) > 1 else ""
    return [f"faster but riskier: #{plan.ranked.index(first) + 1} {first.config.label}, predicted {gain:.0%} faster "
            f"({first.perf.step_time:.3f} s a step against {pick.perf.step_time:.3f} s) with a "
            f"{_chance(first.chance_to_fit)} chance to fit{more}; `pipette tune` tries it and keeps it if it runs"]


def memory_figure_lines(memory: Any, stack: str) -> list[str]:
    """The estimate's three figures (``pipette.estimates.CAPACITY_FIGURES``), and which of them the stack
    compares with the device's capacity: the one its fits prior was fitted on."""
    lines = [f"    {'live tensors':<15} {memory.live_bytes / GiB:>9.2f} GiB  (what max_memory_allocated reports)",
             f"    {'reserved':<15} {memory.reserved_bytes / GiB:>9.2f} GiB  (the caching allocator's reserve: "
             "max_memory_reserved)"]
    if memory.outside_bytes:
        lines.append(f"    {'device-used':<15} {memory.device_used_bytes / GiB:>9.2f} GiB  (the reserve and "
                     f"{memory.outside_bytes / GiB:.2f} GiB of CUDA context, NCCL buffers and workspaces: what "
                     "nvidia-smi shows)")
    lines.append(f"  compared with the device's {memory.capacity_bytes / GiB:.1f} GiB: the {memory.capacity_figure} "
                 f"figure ({stack}'s fits prior was fitted on it)")
    return lines


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


def _variant(plan: Any, cfg: Any) -> str:
    """The candidate's stack, with FSDP2's HSDP degrees and CPU offload when it has them."""
    hsdp = "" if cfg.dp_shard is None else f" hsdp {cfg.dp // cfg.dp_shard}x{cfg.dp_shard}"
    return f"{plan.stack_of(cfg).key}{hsdp}{' offload' if cfg.offload else ''}"


def _print_plan(plan: Any, top: int, elapsed: float) -> None:
    """The plan in text: what was planned, the ranked candidates, the dropped ones, the best one."""
    _print_summary(plan, elapsed)
    _print_ranked(plan, top)
    _print_dropped(plan)
    _print_best(plan)


def _print_summary(plan: Any, elapsed: float) -> None:
    """The model and recipe, the cluster, the stacks, and the candidate counts."""
    c = plan.cluster
    print(
        f"{plan.model.name} ({plan.model.total_params() / 1e9:.2f}B params), "
        f"{plan.training.method}, {plan.training.dtype}, global batch {plan.training.global_batch} "
        f"x {plan.training.seq_len} tokens"
    )
    if plan.training.document_len is not None:
        print(f"packed: documents of {plan.training.document_len} tokens, attending within themselves")
    print(f"cluster {c.name}: {len(c.nodes)} nodes, {c.world} x {c.device_spec.name}")
    for st in plan.all_stacks:
        print(f"stack {st.key}: {st.frameworks}" + (f" ({st.options_note})" if st.options_note else ""))
        if plan.training.document_len is not None and not st.constants.varlen_attention:
            print(f"  {st.key} attends over whole sequences (no document boundaries): priced so")
    for note in plan.calibration_notes:
        print(f"  not calibrated here: {note}")
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


def _print_ranked(plan: Any, top: int) -> None:
    """The table of the ``top`` ranked candidates."""
    cps = any(p.config.cp > 1 for p in plan.ranked[:top])  # a cp column only where a layout splits sequences
    eps = any(p.config.ep > 1 for p in plan.ranked[:top])  # an ep column only where one splits experts
    etps = any(p.config.etp is not None for p in plan.ranked[:top])  # an etp column where experts drop tp
    routes = any(p.config.routing is not None for p in plan.ranked[:top])  # routing where the job lists several
    flexes = any(p.config.dispatcher is not None for p in plan.ranked[:top])  # the dispatcher where one is flex
    cp_head = (f" {'cp':>3}" if cps else "") + (f" {'ep':>3}" if eps else "") + (f" {'etp':>3}" if etps else "") \
        + (f" {'routing':>8}" if routes else "") + (f" {'dispatch':>8}" if flexes else "")
    header = f"{'#':>3} {'tp':>3} {'pp':>3} {'dp':>4}{cp_head} {'mbs':>3} {'zero':>4} {'recompute':>9} " \
             f"{'schedule':>8} {'step s':>9} {'tokens/s':>11} {'MFU':>6} {'HFU':>6} {'peak GiB':>15} {'fit':>5}  stack"
    print(header)
    for i, p in enumerate(plan.ranked[:top], 1):
        cfg = p.config
        sched = cfg.schedule if cfg.schedule == "1f1b" else f"int-v{cfg.virtual_stages}"
        mem = f"{p.memory.peak_bytes / GiB:.1f}/{p.memory.capacity_bytes / GiB:.0f}"
        print(
            f"{i:>3} {cfg.tp:>3} {cfg.pp:>3} {cfg.dp:>4}{f' {cfg.cp:>3}' if cps else ''}"
            f"{f' {cfg.ep:>3}' if eps else ''}{f' {cfg.etp or cfg.tp:>3}' if etps else ''}"
            f"{f' {_routing(plan, cfg):>8}' if routes else ''}{f' {_dispatch(cfg):>8}' if flexes else ''} {cfg.mbs:>3} "
            f"{cfg.zero_stage:>4} "
            f"{cfg.recompute:>9} {sched:>8} {p.perf.step_time:>9.3f} {p.perf.tokens_per_s:>11,.0f} "
            f"{p.perf.mfu:>6.1%} {p.perf.hfu:>6.1%} {mem:>15} {_chance(p.chance_to_fit):>5}  {_variant(plan, cfg)}"
        )


def _routing(plan: Any, cfg: Any) -> str:
    """A candidate's MoE routing as the table names it: its own, or the model's."""
    from pipette.routing import routing_name

    moe = plan.model.moe
    return cfg.routing or (routing_name(moe.capacity_factor) if moe is not None else "-")


def _dispatch(cfg: Any) -> str:
    """A candidate's token dispatcher as the table names it (``-`` where no token leaves its rank)."""
    return cfg.dispatcher or ("a2a" if cfg.ep * cfg.tp > 1 else "-")


def _print_dropped(plan: Any) -> None:
    """How many candidates each rule dropped."""
    from pipette.plan import DROP_REASONS

    print("\ndropped:" if sum(plan.dropped.values()) else "\ndropped: none")
    for code, count in plan.dropped.most_common():
        if count:
            print(f"  {count:>6}  {DROP_REASONS.get(code, code)}")


#: what a user of AutoEP with transformers 5.25 meets (workers.rank.autoep, which Pipette's own runs apply)
AUTOEP_NOTE = ("With transformers 5.25, DeepSpeed 0.19.8's AutoEP stops deepspeed.initialize with "
               "\"_CanRecordRegistry.get() takes 2 positional arguments\": call "
               "workers.rank.autoep.accept_class_name_keys() first (docs/moe.md).")


def _print_best(plan: Any) -> None:
    """The best-ranked candidate: its placement, its time and memory part by part, its chance to fit."""
    from pipette.estimates import MEMORY_PARTS, TIME_PARTS

    best = plan.best
    print(f"\nbest: {best.config.label}  (placement: {best.placement_method}; "
          f"default placement {best.default_step_time:.3f} s -> {best.perf.step_time:.3f} s)")
    stack = best.config.stack or plan.stack.name
    if best.config.ep > 1 and stack.split("+", 1)[0] in AUTOEP_STACKS:
        print(f"  experts: DeepSpeed's AutoEP (ds_config expert_parallel, autoep_size {best.config.ep}; DeepSpeed "
              f">= 0.19). {AUTOEP_NOTE}")
    print("  time per step:")
    for part in (*TIME_PARTS, *(k for k in best.perf.breakdown if k not in TIME_PARTS)):
        value = best.perf.breakdown.get(part, 0.0)
        if value > 0:
            print(f"    {part:<15} {value:>9.4f} s  {value / best.perf.step_time:>6.1%}")
    print(f"  memory on the heaviest rank (stage {best.memory.stage}):")
    for part in MEMORY_PARTS:
        value = best.memory.breakdown.get(part, 0)
        if value > 0:
            print(f"    {part:<15} {value / GiB:>9.2f} GiB")
    for line in memory_figure_lines(best.memory, plan.stack_of(best.config).key):
        print(line)
    if plan.fits_prior is not None:
        print(f"  {fits_sentence(best, plan.fits_prior)}")
        if not best.sure_to_fit:
            sure = next((p for p in plan.ranked if p.sure_to_fit), None)
            if sure is not None:
                print(f"  if it runs out of memory: {sure.config.label}, sure to fit, predicted "
                      f"{sure.perf.step_time:.3f} s a step (`pipette tune` tries both)")
