"""Real trials on this machine: the tuner against exhaustive ground truth (issue 4,
"Benchmarks" 2).

tiny-llama fine-tuned with LoRA (the ``pipette tune`` default recipe: global batch 16 x 128
tokens, fp32, rank 8, alpha 16) on 4 CPU devices, local Ray, real DeepSpeed trials through
``workers.host.runner.RayTrialRunner``. Run from the repository root::

    .venv/bin/python tests/benchmarks/real_tuning.py                  # restricted space (72 candidates)
    .venv/bin/python tests/benchmarks/real_tuning.py --wide           # the recipe's full space (228)
    .venv/bin/python tests/benchmarks/real_tuning.py --limit 6 --top 2 --repeats 1   # a smoke run
    .venv/bin/python tests/benchmarks/real_tuning.py --stack pipette,fsdp  # both families (99 candidates)
    .venv/bin/python tests/benchmarks/real_tuning.py --stack fsdp --model M.json --seq-len 4096 --global-batch 2 \\
        --method full --zero 0 --fsdp-full  # context parallelism offered (issue 48)

``--stack pipette,fsdp`` plans both stacks as ``pipette tune --stack pipette,fsdp`` does, each
candidate trained by its stack's runner; the restriction is per stack (``RESTRICTED_ZERO``,
``RESTRICTED_FSDP``) and the report gives each family's best and the tuner's picks of it.

1. Plan (``pipette.plan.make_plan``) on the cluster: measured by ``workers.host.probe.probe_cluster``
   (``--cluster FILE`` uses a cluster file instead, e.g. ``examples/clusters/cpu-4.yaml``).
   Candidates = the plan's candidates the backends run (``RayTrialRunner.refusals``).
   The full space is ~230 runnable candidates at 20-80 s a trial on 2 cores, so by default
   the recipe is restricted to micro-batches 1/2/4, ZeRO 0/1, recomputation none/full and
   the 1F1B schedule; ``--wide`` lifts it (or set each with ``--micro-batches`` etc.).
   ``--limit N`` keeps the plan's first N runnable candidates (a smoke run): both the
   exhaustive pass and the tuner then work on those N.
2. Exhaustive ground truth: every candidate once, in plan order, not pruned; a trial that
   failed or timed out for another reason than memory is retried once, as the tuner does
   (the first trial after Ray starts can time out on a loaded machine).
3. The tuner, in the same run, with a budget of ``floor(25%)`` of the candidates (the
   target's limit: the candidates it tries; its re-timing trials of candidates already tried
   come on top and are counted separately: ``TuneOptions.for_search``, every re-timing round
   on top, 9 trials at most, since 2026-11-26; one round, 3 trials, before), default
   ``TuneOptions`` otherwise (its own stop
   rule may end it sooner), no prior trials (it never sees the exhaustive pass or its own
   earlier runs). ``--runs N`` runs it N times after the one exhaustive pass (seeds 0..N-1;
   the trials' noise differs between runs); the target holds when every run's pick does.
4. Noise: one trial's step time is the median of its timed steps (the runner stops when the
   95% interval is within 5% or at ``--steps``); between trials the machine's load moves
   (other processes share the 2 cores). So the exhaustive top ``--top`` candidates and the
   tuner's pick are timed ``--repeats`` more times, in interleaved rounds (every candidate
   once per round, so a load change hits all of them alike), and each is ranked by the
   median of all its trial medians (the exhaustive, tuner and repeat trials that ran to
   the end; pruned ones are partial and left out). The target is judged on those medians: the pick's
   median within 5% of the best median. The spread of the repeats (max/min of a
   candidate's trial medians) is printed, so a reader can see whether noise could decide,
   and so is the yardstick's own certainty (``ground_truth_certainty``: a bootstrap of the
   trial medians, the share of resamples in which each pick is within 5% of the best).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from pipette.cluster import ClusterProfile  # noqa: E402
from pipette.config import ParallelConfig  # noqa: E402
from pipette.errors import PipetteError, SpecError  # noqa: E402
from pipette.measurement import Measurement  # noqa: E402
from pipette.model import ModelSpec  # noqa: E402
from pipette.plan import Planned, make_plan  # noqa: E402
from pipette.training import LoraSpec, TrainingSpec  # noqa: E402
from pipette.tuner import TuneEvent, TuneOptions, Tuner  # noqa: E402

#: The issue's target: the pick within this fraction of the exhaustive best ...
WITHIN = 0.05
#: ... while trying at most this share of the candidates.
TRIAL_SHARE = 0.25
RESTRICTED = {"micro_batches": (1, 2, 4), "zero_stages": (0, 1), "recompute": ("none", "full"),
              "schedules": ("1f1b",)}
#: The restriction's sharding modes per stack (``--stack``): DeepSpeed's ZeRO 0/1; FSDP's NO_SHARD (0),
#: SHARD_GRAD_OP (2: no reshard after the forward, ZeRO-2-like) and FULL_SHARD (3: reshard, ZeRO-3-like).
#: HSDP and CPU offload are left out of the restricted space.
RESTRICTED_ZERO = {"pipette": (0, 1), "fsdp": (0, 2, 3)}
#: And within fsdp, tensor parallelism 1 and no recomputation: an fsdp trial takes 25-75 s on the
#: 2-core VM (against ~11 s for DeepSpeed's; results/cpu-2026-11-27/fsdp_cpu_calibration.json), so
#: the full restriction's 108 fsdp candidates would take ~1 h; tp 1 x pp 1/2/4 x mbs 1/2/4 x
#: modes 0/2/3 (27) keep the exhaustive pass of both families near 30 min.
RESTRICTED_FSDP = {"tp": (1,), "recompute": ("none",)}


def recipe(args: argparse.Namespace) -> TrainingSpec:
    """``pipette tune``'s embedded default recipe, restricted unless ``--wide``."""
    limits: dict[str, Any] = {} if args.wide else dict(RESTRICTED)
    if not args.wide:  # the union of the stacks' modes; ``restricted`` keeps each stack's own
        limits["zero_stages"] = tuple(sorted({z for s in stack_names(args) for z in RESTRICTED_ZERO.get(s, (0, 1))}))
    for name, raw, kind in (("micro_batches", args.micro_batches, int), ("zero_stages", args.zero, int),
                            ("recompute", args.recompute, str), ("schedules", args.schedules, str)):
        if raw:
            try:
                limits[name] = tuple(kind(x) for x in raw.split(",") if x.strip())
            except ValueError:
                raise SpecError(f"is {raw!r}", field="--" + name.replace("_", "-"),
                                fix="give a comma-separated list, e.g. 1,2,4") from None
    lora = {"lora": LoraSpec(rank=8, alpha=16.0)} if args.method == "lora" else {}
    return TrainingSpec(global_batch=args.global_batch, seq_len=args.seq_len, dtype="fp32", method=args.method,
                        **lora, **limits)


def stack_names(args: argparse.Namespace) -> list[str]:
    """The stacks ``--stack`` names (``pipette,fsdp``), by name."""
    from pipette.stacks import get_stacks

    return [s.name for s in get_stacks(args.stack, field="--stack")]


def restricted(args: argparse.Namespace, config: ParallelConfig) -> bool:
    """Whether ``config`` is in the restricted space of its stack (always, with ``--wide``): its
    stack's sharding modes (``RESTRICTED_ZERO``, unless ``--zero``), no HSDP, no CPU offload, and
    for fsdp ``RESTRICTED_FSDP`` (unless ``--fsdp-full``)."""
    if args.wide:
        return True
    if config.dp_shard is not None or config.offload:
        return False
    stack = config.stack or stack_names(args)[0]
    if stack == "fsdp" and not args.fsdp_full and (config.tp not in RESTRICTED_FSDP["tp"]
                                                   or config.recompute not in RESTRICTED_FSDP["recompute"]):
        return False
    return bool(args.zero) or config.zero_stage in RESTRICTED_ZERO.get(stack, (0, 1))


def family(label: str, stacks: Sequence[str]) -> str:
    """The stack of a candidate's label in a plan of ``stacks`` (the label's suffix when several)."""
    if len(stacks) > 1:
        for s in stacks:
            if label.endswith("-" + s):
                return s
    return stacks[0]


@dataclass
class Timed:
    """Every trial of one candidate."""

    planned: Planned
    trials: list[Measurement] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.planned.config.label

    @property
    def medians(self) -> list[float]:
        return [m.step_time for m in self.trials if m.status == "ok" and m.step_time]

    @property
    def time(self) -> float:
        """Median of the trials' median step times; inf when none succeeded."""
        return statistics.median(self.medians) if self.medians else math.inf

    @property
    def spread(self) -> float:
        m = self.medians
        return max(m) / min(m) - 1.0 if len(m) > 1 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"label": self.label, "config": self.planned.config.to_dict(),
                "predicted_step_time": self.planned.perf.step_time, "step_time": _finite(self.time),
                "spread": self.spread, "trials": [m.to_dict() for m in self.trials]}


def _finite(x: float) -> float | None:
    return None if math.isinf(x) else x


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def measure(runner: Any, t: Timed, why: str) -> Measurement:
    start = time.monotonic()
    m: Measurement = runner(t.planned.config, lambda p: False)
    t.trials.append(m)
    shown = f"{m.step_time:.3f} s" if m.step_time else m.error.splitlines()[0][:100] if m.error else "-"
    log(f"  {why:<12} {t.label:<40} {m.status:<7} {shown}  ({time.monotonic() - start:.0f} s)")
    return m


def get_cluster(args: argparse.Namespace, model: ModelSpec) -> ClusterProfile:
    if args.cluster:
        from pipette.clusterfile import load_cluster

        return load_cluster(args.cluster)
    from workers.host.probe import probe_cluster

    log(f"measuring the local cluster: {args.devices} CPU devices ...")
    return probe_cluster(name=f"local-cpu-{args.devices}", cpu_devices_per_node=args.devices, model=model)


def run(args: argparse.Namespace, model: ModelSpec | None = None, training: TrainingSpec | None = None,
        make_runner: Callable[[ModelSpec, TrainingSpec, ClusterProfile], Any] | None = None,
        cluster: ClusterProfile | None = None) -> dict[str, Any]:
    """The whole benchmark; ``model``, ``training``, ``make_runner`` and ``cluster`` replace the
    defaults (``tests/benchmarks/script_tuning.py`` runs it on a user's script)."""
    from workers.host.ray_cluster import ensure_ray
    from workers.host.runner import RayTrialRunner

    started = time.monotonic()
    model = model or (ModelSpec.from_hf_config(args.model) if args.model.endswith(".json")
                      else ModelSpec.preset(args.model))
    own_recipe = training is None  # a caller's recipe is taken as given (no per-stack restriction)
    training = training or recipe(args)
    ensure_ray()
    cluster = cluster or get_cluster(args, model)
    stacks = stack_names(args)
    plan = make_plan(model, training, cluster, seed=args.seed, stack=args.stack)
    if make_runner is not None:
        runner = make_runner(model, training, cluster)
    else:  # a candidate of a plan of several stacks runs on its own stack's runner (config.stack)
        runner = RayTrialRunner(model, training, cluster, device_kind=cluster.device_spec.kind,
                                timeout_s=args.trial_timeout, max_steps=args.steps, seed=args.seed,
                                stack=stacks[0])
    runnable = [p for p in plan.ranked if not runner.refusals(p.config)
                and (not own_recipe or restricted(args, p.config))]
    if args.limit is not None:
        runnable = runnable[: args.limit]
    if not runnable:
        raise SpecError("no candidate the backends can run", field="recipe", fix="widen the recipe (--wide)")
    chosen = {p.config.label for p in runnable}
    budget = max(1, math.floor(TRIAL_SHARE * len(runnable)))
    by_stack = {s: sum(1 for p in runnable if family(p.config.label, stacks) == s) for s in stacks}
    log(f"{plan.enumerated} enumerated, {len(plan.ranked)} fit, {len(runnable)} runnable candidates"
        + (" (" + ", ".join(f"{s} {n}" for s, n in by_stack.items()) + ")" if len(stacks) > 1 else "")
        + (f" (--limit {args.limit})" if args.limit is not None else "") + f"; tuner budget {budget} trials")

    # 2. exhaustive ground truth
    log("exhaustive pass (every candidate once):")
    timed = {p.config.label: Timed(p) for p in runnable}
    t0 = time.monotonic()
    for t in timed.values():
        if measure(runner, t, "exhaustive").status in ("failed", "timeout"):
            measure(runner, t, "retry")  # as the tuner retries: a transient must not decide
    exhaustive_s = time.monotonic() - t0

    # 3. the tuner, same run, no prior
    log(f"tuner (budget {budget} trials):")

    def refuse(c: ParallelConfig) -> list[str]:
        return runner.refusals(c) + ([] if c.label in chosen else ["outside the benchmark's space"])

    def on_event(e: TuneEvent) -> None:
        if e.kind == "trial_ended" and e.record is not None:
            r, m = e.record, e.record.measurement
            shown = f"{m.step_time:.3f} s" if m.step_time else "-"
            log(f"  {'tuner #' + str(e.trial):<12} {r.label:<40} {m.status:<7} "
                f"{shown} (predicted {r.predicted_step_time:.3f} s)")

    runs = []
    for n in range(args.runs):
        t0 = time.monotonic()
        # the budget counts candidates tried; every re-timing round comes on top
        options = TuneOptions.for_search(budget, seed=args.seed + n)
        result = Tuner(plan, options, runnable=refuse).run(runner, on_event=on_event)
        tried = {r.label for r in result.trials}
        pick = result.best.config.label if result.best is not None else None
        runs.append({"seed": args.seed + n, "candidates_tried": len(tried), "attempts": len(result.trials),
                     "retimed": sum(1 for r in result.trials if r.purpose == "retime"), "pick": pick,
                     "confidence": result.confidence, "learned": result.learned,
                     "stop_reason": result.stop_reason, "seconds": time.monotonic() - t0,
                     "trials_detail": [t.to_dict() for t in result.trials]})
        log(f"  run {n + 1}: pick {pick} after {len(tried)} candidates ({len(result.trials)} trials), "
            f"{result.stop_reason}")
        for record in result.trials:  # the tuner's full trials are real timings of the same run too
            if record.measurement.status == "ok" and record.label in timed:
                timed[record.label].trials.append(record.measurement)

    # 4. noise: interleaved repeats of the exhaustive top few and the tuner's pick
    ranked = sorted(timed.values(), key=lambda t: (t.time, t.label))
    repeat = [t.label for t in ranked[: args.top] if math.isfinite(t.time)]
    for r in runs:
        if r["pick"] is not None and r["pick"] not in repeat:
            repeat.append(r["pick"])
    if args.repeats > 0 and repeat:
        log(f"repeats ({args.repeats} rounds of {len(repeat)} candidates, interleaved):")
    for r in range(args.repeats):
        order = repeat if r % 2 == 0 else list(reversed(repeat))
        for label in order:
            measure(runner, timed[label], f"repeat {r + 1}")

    ranked = sorted(timed.values(), key=lambda t: (t.time, t.label))
    best = ranked[0]
    for r in runs:
        pick_time = timed[r["pick"]].time if r["pick"] is not None else math.inf
        r["pick_step_time"] = _finite(pick_time)
        r["gap"] = _finite(pick_time / best.time - 1.0 if math.isfinite(best.time) else math.inf)
        r["trial_share"] = r["candidates_tried"] / len(runnable)
        r["target_met"] = bool(r["gap"] is not None and r["gap"] <= WITHIN and r["trial_share"] <= TRIAL_SHARE)
    ok_count = sum(1 for t in timed.values() if t.medians)
    within_share, best_share = ground_truth_certainty({t.label: t.medians for t in timed.values()},
                                                      [r["pick"] for r in runs if r["pick"] is not None])
    for r in runs:
        r["pick_within_share"] = within_share.get(r["pick"]) if r["pick"] is not None else None
    families = {}
    for s in stacks:
        mine = [t for t in ranked if family(t.label, stacks) == s]
        top = mine[0] if mine and math.isfinite(mine[0].time) else None
        families[s] = {"candidates": len(mine), "best": top.label if top else None,
                       "best_step_time": _finite(top.time) if top else None,
                       "picks": [r["pick"] for r in runs if r["pick"] is not None and family(r["pick"], stacks) == s]}
    return {
        "model": model.name, "stacks": stacks, "families": families, "training": training.to_dict(),
        "cluster": {"name": cluster.name, "devices": cluster.world},
        "restricted": not args.wide, "limit": args.limit, "candidates": len(runnable), "feasible": ok_count,
        "budget": budget, "runs": runs,
        "exhaustive": {"best": best.label, "best_step_time": _finite(best.time), "seconds": exhaustive_s,
                       "ranking": [t.to_dict() for t in ranked]},
        "repeated": repeat, "repeats": args.repeats, "best_share": best_share,
        "target_met": all(r["target_met"] for r in runs), "runs_met": sum(r["target_met"] for r in runs),
        "seconds": time.monotonic() - started,
    }


def ground_truth_certainty(medians: dict[str, list[float]], picks: Sequence[str], within: float = WITHIN,
                           resamples: int = 2000, seed: int = 0) -> tuple[dict[str, float], dict[str, float]]:
    """How sure the benchmark's own yardstick is (a bootstrap: every candidate's trial medians
    resampled with replacement, ``resamples`` times): per pick, the share of resamples in which
    its median is within ``within`` of the best median; per candidate, the share in which it is
    the best. A verdict ("met", "MISSED") near the tolerance means little when these are far
    from 0 and 1 (measured 2026-11-26: the exhaustive best was the best in 50% and 60% of
    resamples in two runs). The best of a resample is a minimum over every candidate's resampled
    median, biased low (the luckiest wins), so the shares within the tolerance are conservative."""
    rng = random.Random(seed)
    data = {k: v for k, v in medians.items() if v}
    picks = list(dict.fromkeys(picks))  # runs often share a pick
    hits = dict.fromkeys(picks, 0)
    best_count: dict[str, int] = {}
    for _ in range(resamples):
        med = {k: statistics.median(rng.choices(v, k=len(v))) for k, v in data.items()}
        best = min(med, key=lambda k: (med[k], k))
        best_count[best] = best_count.get(best, 0) + 1
        for p in picks:
            if p in med and med[p] <= (1.0 + within) * med[best]:
                hits[p] += 1
    return ({p: n / resamples for p, n in hits.items()},
            {k: n / resamples for k, n in sorted(best_count.items(), key=lambda kv: -kv[1])})


def report(out: dict[str, Any]) -> None:
    ex = out["exhaustive"]
    picks = {r["pick"] for r in out["runs"]}
    method = "LoRA" if out["training"].get("method", "lora") == "lora" else "full fine-tuning"
    print(f"Real tuning: {out['model']} {method} at {out['training'].get('seq_len')} tokens on "
          f"{out['cluster']['devices']} CPU devices "
          f"({'restricted' if out['restricted'] else 'full'} space"
          + (f", --limit {out['limit']}" if out["limit"] is not None else "") + ")")
    print(f"  candidates: {out['candidates']} runnable, {out['feasible']} ran ok "
          f"(exhaustive pass {ex['seconds']:.0f} s)")
    print(f"  {'rank':>4}  {'candidate':<40} {'median s':>9} {'trials':>6} {'spread':>7} {'predicted':>9}")
    for i, t in enumerate(ex["ranking"][:10]):
        n = sum(1 for m in t["trials"] if m["status"] == "ok")
        st = f"{t['step_time']:.3f}" if t["step_time"] else "-"
        mark = " <- a tuner pick" if t["label"] in picks else ""
        print(f"  {i + 1:>4}  {t['label']:<40} {st:>9} {n:>6} {t['spread']:>6.1%} "
              f"{t['predicted_step_time']:>9.3f}{mark}")
    for n, r in enumerate(out["runs"]):
        gap = "-" if r["gap"] is None else f"{r['gap']:+.1%}"
        sure = "-" if r["confidence"] is None else f"{r['confidence']:.0%}"
        print(f"  run {n + 1}: {r['candidates_tried']} candidates tried ({r['trial_share']:.0%}, budget "
              f"{out['budget']}) + {r['retimed']} re-timing trials, {r['seconds']:.0f} s; pick {r['pick']} "
              f"{gap} against the exhaustive best {ex['best']} (said {sure} sure); "
              f"{'met' if r['target_met'] else 'MISSED'}"
              + (f" (within {WITHIN:.0%} in {r['pick_within_share']:.0%} of the truth's resamples)"
                 if r.get("pick_within_share") is not None else ""))
    if len(out.get("stacks", [])) > 1:
        for s, f in out["families"].items():
            best = f"{f['best']} {f['best_step_time']:.3f} s" if f["best"] else "none ran"
            print(f"  family {s}: {f['candidates']} candidates, best {best}; tuner picks of this family: "
                  f"{len(f['picks'])} of {len(out['runs'])} runs" + (f" ({', '.join(sorted(set(f['picks'])))})"
                                                                   if f["picks"] else ""))
    if out.get("best_share"):
        print("  the ground truth's own certainty (bootstrap of every candidate's trial medians): the best is "
              + ", ".join(f"{k} in {v:.0%}" for k, v in list(out["best_share"].items())[:4]) + " of resamples")
    print(f"  target (within {WITHIN:.0%} trying <= {TRIAL_SHARE:.0%}): {out['runs_met']} of {len(out['runs'])} "
          f"runs: {'MET' if out['target_met'] else 'MISSED'}   ({out['seconds']:.0f} s in all)")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="tiny-llama", help="a preset or a config.json (default tiny-llama)")
    # the recipe: pipette tune's default (16 x 128 tokens, LoRA) unless given; a long --seq-len
    # is where context parallelism is offered (docs/context-parallel.md)
    ap.add_argument("--global-batch", type=int, default=16, help="sequences per step (default 16)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    ap.add_argument("--method", choices=("lora", "full"), default="lora", help="fine-tuning method (default lora)")
    ap.add_argument("--stack", default="pipette",
                    help="the stack(s) to plan and tune, as `pipette tune --stack` (pipette,fsdp: both families)")
    ap.add_argument("--devices", type=int, default=4, help="CPU devices to probe (default 4)")
    ap.add_argument("--cluster", help="a cluster file instead of probing (e.g. examples/clusters/cpu-4.yaml)")
    ap.add_argument("--wide", action="store_true", help="the recipe's full space (~230 candidates)")
    ap.add_argument("--fsdp-full", action="store_true",
                    help="fsdp's restricted space without RESTRICTED_FSDP (every layout, recompute none/full)")
    ap.add_argument("--micro-batches", help="comma-separated, overrides the restriction")
    ap.add_argument("--zero", help="comma-separated ZeRO stages, overrides the restriction")
    ap.add_argument("--recompute", help="comma-separated modes, overrides the restriction")
    ap.add_argument("--schedules", help="comma-separated schedules, overrides the restriction")
    ap.add_argument("--limit", type=int, help="only the plan's first N runnable candidates (smoke run)")
    # 4 x 4 since 2026-11-26 (3 x 2 before): trials are cheaper since (tests/benchmarks/trial_overhead.py)
    # and with 3 x 2 the ground truth's best was the best in only 50% of bootstrap resamples
    ap.add_argument("--top", type=int, default=4, help="exhaustive top candidates to repeat (default 4)")
    ap.add_argument("--repeats", type=int, default=4, help="extra interleaved rounds of them (default 4)")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per trial at most (default 8)")
    ap.add_argument("--trial-timeout", type=float, default=300.0, help="seconds (default 300)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=1, help="tuner runs after the one exhaustive pass (default 1)")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    try:
        for name in ("devices", "steps", "top", "runs"):
            if getattr(args, name) < 1:
                raise SpecError(f"is {getattr(args, name)}", field="--" + name, fix="give 1 or more")
        if args.repeats < 0:
            raise SpecError(f"is {args.repeats}", field="--repeats", fix="give 0 or more")
        if args.limit is not None and args.limit < 1:
            raise SpecError(f"is {args.limit}", field="--limit", fix="give 1 or more")
        stack_names(args)  # an unknown stack: one clear line
        out_path = Path(args.out) if args.out else None
        if out_path is not None and not out_path.parent.is_dir():
            raise SpecError(f"folder {str(out_path.parent)!r} does not exist", field="--out",
                            fix="give a path in an existing folder")
        out = run(args)
    except PipetteError as e:
        print(f"real_tuning: {e}", file=sys.stderr)
        return 2
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
    report(out)
    if out_path is not None:
        out_path.write_text(json.dumps(out, indent=1))
        print(f"wrote {out_path}")
    return 0 if out["target_met"] else 1


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["RESTRICTED", "RESTRICTED_ZERO", "family", "main", "recipe", "report", "restricted", "run"]
