"""What a tuning result says, in words: the same lines on the terminal and in ``--json``'s
``summary`` (issue 32, items 4 and 9).

An undecided verdict comes first, so that it does not read like a result; then what happened
to every trial (not "found in 7 trials" when 6 of them timed out); then how sure the pick is,
among the candidates tried and among all of them, said so that the two do not read as a
contradiction; then the placement, and the precision a CPU job trains in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipette.config import ParallelConfig
    from pipette.tuner import TuneResult

#: how each final status reads in the count of trials
STATUS_WORDS = {
    "ok": "ran ok", "timeout": "timed out", "failed": "failed", "oom": "ran out of memory",
    "pruned": "stopped early (slower than the best)",
    "interrupted": "interrupted before its end (Ctrl-C, SIGTERM or a cancel: not for its speed)",
}


def result_dict(result: TuneResult) -> dict[str, Any]:
    """``result.to_dict()`` with its ``summary``: these lines (``--json``, a job's result)."""
    return {"summary": summary_lines(result), **result.to_dict()}


def summary_lines(result: TuneResult) -> list[str]:
    lines = interrupted_first(result) + verdict_first(result)
    lines.append(what_happened(result))
    lines += confidence_lines(result)
    if result.best is not None:
        lines.append(placement_line(result.best.config))
    precision = precision_line(result)
    if precision:
        lines.append(precision)
    return lines


def interrupted_first(result: TuneResult) -> list[str]:
    """An interrupted run says so before its result, which is the best so far, not a search's end."""
    if not result.interrupted:
        return []
    return [f"INTERRUPTED: {result.stop_reason}; what follows is the best so far, not the end of the search"]


def verdict_first(result: TuneResult) -> list[str]:
    """Below the confidence asked: say so, and what would decide it."""
    if result.best is None or result.confidence is None or result.decided:
        return []
    tol = f"{result.tolerance:.0%}"
    head = (f"UNDECIDED: {result.best.label} is only {result.confidence:.0%} sure to be within {tol} of the "
            f"best candidate tried ({result.confidence_asked:.0%} asked); do not take it as the answer yet.")
    return [head, to_decide_line(result)]


def to_decide_line(result: TuneResult) -> str:
    faster = sorted(k for k, v in result.to_decide.items() if v is None)
    counts = {k: v for k, v in result.to_decide.items() if v is not None}
    parts = []
    if counts:
        pick_more = max(counts.values())
        total = pick_more + sum(counts.values())
        each = ", ".join(f"{v} of {k}" for k, v in sorted(counts.items()))
        parts.append(f"about {total} more trials would decide it at the noise measured ({pick_more} of the pick, "
                     f"{each}): rerun with a larger --max-trials")
    if faster:
        parts.append(f"{', '.join(faster)} measured faster on average: more trials would move the pick there, "
                     "not confirm this one")
    if not parts:
        return "  more trials of the contenders would decide it: rerun with a larger --max-trials"
    return "  " + "; ".join(parts)


def what_happened(result: TuneResult) -> str:
    from pipette.tuner import trial_outcomes

    outcomes = trial_outcomes(result.trials)
    search = {k: v for k, v in outcomes.items() if not k.startswith("retime ")}
    retime = sum(v for k, v in outcomes.items() if k.startswith("retime "))
    n = sum(search.values())
    how = ", ".join(f"{v} {STATUS_WORDS.get(k, k)}" for k, v in sorted(search.items(), key=lambda kv: -kv[1]))
    attempts = len(result.trials) - n - retime
    text = (f"{_n(n, 'trial')} of {_n(_runnable(result), 'candidate')} runnable: {how}"
            + (f" (and {_n(attempts, 'retry', 'retries')})" if attempts > 0 else ""))
    if retime:
        text += f"; then {_n(retime, 're-timing trial')} of the best"
    if search.get("timeout"):
        text += "; a timeout is the candidate's only if it hangs: a longer --trial-timeout gives slow starts room"
    return text


def _n(count: int, word: str, plural: str | None = None) -> str:
    return f"{count} {word if count == 1 else plural or word + 's'}"


def _runnable(result: TuneResult) -> int:
    return result.runnable or len(result.plan.ranked)


def confidence_lines(result: TuneResult) -> list[str]:
    """The two confidences in words: among the candidates measured (the trials), and among all
    of them (the untried ones only as the learned model predicts them)."""
    if result.best is None or result.confidence is None:
        return []
    tol = f"{result.tolerance:.0%}"
    tried = len({t.label for t in result.trials if t.measurement.status == "ok"})
    noise = float(result.learned.get("trial_noise_sd", 0.0))
    noise_text = f"trial-to-trial noise {noise:.1%}{interference_words(result.interference)}"
    if tried == 1:
        lines = [f"only the pick ran ok: no measured candidate to compare it with ({noise_text})"]
    else:
        lines = [f"among the {tried} candidates that ran ok: {result.confidence:.0%} sure the pick is within {tol} "
                 f"of the fastest ({noise_text})"]
    untried = untried_line(result)
    return lines + ([untried] if untried else [])


def untried_line(result: TuneResult) -> str | None:
    """The candidates never tried, as the learned model predicts them: what that means and what to
    do. The tuner's own stop rule sets the tone: when the untried ones together are under its
    ``stop_probability`` to beat the pick, they are said to be unlikely; else how many more trials
    would settle it. When the measured candidates decided, the pick stands among them: the untried
    ones are a lead to follow, not an alarm (it read "the pick is 0% sure" at the end of every run)."""
    untried = _runnable(result) - len({t.label for t in result.trials})
    if result.confidence is None or result.confidence_overall is None or untried <= 0:
        return None
    tol = f"{result.tolerance:.0%}"
    beaten = 1.0 - result.confidence_overall / result.confidence if result.confidence > 0 else 1.0
    tried = len({t.label for t in result.trials})
    head = f"{_n(untried, 'candidate')} never tried, predicted by the learned model from {_n(tried, 'candidate')} tried"
    more = result.untried_to_try
    if more == 0:
        return (f"{head}: a {beaten:.0%} chance together that one is more than {tol} faster than the pick, "
                "none worth a trial")
    likeliest = (f" (the likeliest, {result.untried_likeliest[0]}, {result.untried_likeliest[1]:.0%})"
                 if result.untried_likeliest else "")
    meaning = (f": each has some chance to be more than {tol} faster than the pick{likeliest}, which adds up to "
               f"{beaten:.0%} that one of them is")
    todo = ("to settle it, give the search more trials (--max-trials): it tries the likeliest first and stops once "
            "the rest are unlikely" + (f": about {_n(more, 'more trial')} if none of the likeliest turns out faster"
                                       if more else ""))
    if result.decided:
        return f"{head}{meaning}; a prediction, not a measurement: the pick stands among those measured; {todo}"
    return (f"{head}{meaning}, so with them the pick is {result.confidence_overall:.0%} sure (a prediction, not a "
            f"measurement); {todo}")


def interference_words(interference: dict[str, Any]) -> str:
    """The machine's other work during the trials, beside the noise it causes: the cores that
    processes other than this job's ranks kept busy, and other processes on the GPUs
    (``cli.interference``)."""
    others = interference.get("others_cores") or []
    cores = interference.get("cores")
    if not others or not cores:
        return ""
    low, high = min(others), max(others)
    text = f"; other processes kept {low:.1f}-{high:.1f} of the {cores} cores busy during the trials"
    if high >= 0.25 * cores:
        text += ": a busy machine, its load moves the step times"
    on_gpus = interference.get("gpu_others") or []
    if on_gpus and max(on_gpus) > 0:
        most = max(on_gpus)
        held = max(interference.get("gpu_others_bytes") or [0]) / 2**30
        text += (f"; {most} other process{'es' if most > 1 else ''} on the GPUs (up to {held:.1f} GiB) during "
                 f"{sum(1 for n in on_gpus if n)} of {len(on_gpus)} trials: they share the devices' compute and memory")
    return text


#: the placement sentence names each rank's device up to this many ranks (rank_map.json has them all)
LISTED_RANKS = 8


def placement_line(config: ParallelConfig) -> str:
    """Where each rank runs, every rank named (the ones that stay on their own device too: it once
    read "rank 2 on device 0;" for 4 ranks, the last one left out), up to ``LISTED_RANKS``."""
    devices = list(config.devices())
    if devices == list(range(len(devices))):
        return f"placement {devices}: rank i runs on device i"
    listed = ", ".join(f"rank {r} on device {d}" for r, d in enumerate(devices[:LISTED_RANKS]))
    rest = f", ... (all {len(devices)} in rank_map.json)" if len(devices) > LISTED_RANKS else ""
    groups = f" (tp groups are {config.tp} consecutive ranks)" if config.tp > 1 else ""
    return (f"placement {devices}: rank i runs on device placement[i], here {listed}{rest}{groups}; the planner "
            "placed the ranks that talk most on the fastest links it measured; launch.sh and rank_map.json keep "
            "this order")


def degrees(config: dict[str, Any]) -> list[tuple[str, int]]:
    """A candidate's degrees as printed (``ParallelConfig.to_dict``'s): tp, pp and dp always, cp and
    ep only when not 1, as its label and dict write them."""
    return [(k, int(config[k])) for k in ("tp", "pp", "dp")] + \
        [(k, int(config[k])) for k in ("cp", "ep") if config.get(k, 1) != 1]


def precision_line(result: TuneResult) -> str | None:
    training, cluster = result.plan.training, result.plan.cluster
    if cluster.device_spec.kind == "cpu" and training.dtype == "tf32":
        return ("trained in fp32: tf32 is fp32 with its matmuls on a GPU's TF32 tensor cores, which CPU devices "
                "do not have; a GPU run in tf32 is timed on its own cluster")
    if cluster.device_spec.kind == "cpu" and training.dtype == "fp32":
        return ("trained in fp32: CPU devices emulate bf16 matmuls (slower), so these step times are fp32's; "
                "a GPU run in bf16 is timed on its own cluster")
    return None
