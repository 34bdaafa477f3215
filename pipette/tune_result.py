"""What a search hands back (``TuneResult``): the pick, how sure it is, every trial, and the launch
files of the pick; and how each trial ended, as said to a user (``how_it_ended``)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipette.errors import InfeasibleError
from pipette.feasibility import measured_need
from pipette.fits import default_prior, memory_headroom
from pipette.measurement import Measurement
from pipette.plan import Plan
from pipette.trials import TrialRecord


@dataclass
class TuneResult:
    plan: Plan
    trials: tuple[TrialRecord, ...]
    stop_reason: str
    best: TrialRecord | None
    interrupted: bool = False
    unrunnable: Counter[str] = field(default_factory=Counter)
    #: probability that ``best`` is within the tolerance of the best candidate tried
    confidence: float | None = None
    #: probability that it is within the tolerance of every candidate, tried or not: ``confidence``
    #: times the chance that no untried candidate beats it by more (``Tuner.confidence_overall``)
    confidence_overall: float | None = None
    #: how much the learned model trusted the analytic prior, and the noise it measured
    learned: dict[str, float | int] = field(default_factory=dict)
    tolerance: float = 0.02
    #: the confidence asked (``TuneOptions.confidence``): below it the verdict is undecided
    confidence_asked: float = 0.9
    #: the pick's measured step time as it was picked: the geometric mean (the mean of the log,
    #: ``measured_means``) over its ok trials, and how many there were
    pick_step_time: float | None = None
    pick_trials: int = 0
    #: per contender the pick is not yet ``confidence_asked`` sure against: more trials of each
    #: that would decide it at the noise measured (``Tuner.trials_to_decide``; None: none would)
    to_decide: dict[str, int | None] = field(default_factory=dict)
    #: what else ran on the machine during the trials (``cli.interference``)
    interference: dict[str, Any] = field(default_factory=dict)
    #: the candidates the trial backend (or the script) can run: those the search chose from
    runnable: int = 0
    #: how many of the likeliest untried candidates to try before the rest together have less than
    #: ``stop_probability`` chance to beat the pick (``stop_rule.Untried.to_try``); None before an ok trial
    untried_to_try: int | None = None
    #: the untried candidate likeliest to beat the pick by more than the tolerance, and that chance
    untried_likeliest: tuple[str, float] | None = None

    @property
    def decided(self) -> bool:
        return self.confidence is not None and self.confidence >= self.confidence_asked

    def to_dict(self) -> dict[str, Any]:
        """The result as data; ``pipette.result_text.result_dict`` adds its ``summary`` in words."""
        best = None
        if self.best is not None:
            b, m = self.best, self.best.measurement
            best = {
                **b.to_dict(),
                "side_by_side": {
                    "step_time_s": {"analytic": b.analytic_step_time, "learned": b.predicted_step_time,
                                    "measured": self.pick_step_time or m.step_time,
                                    "measured_trials": self.pick_trials or 1},
                    "tokens_per_s": {"analytic": b.perf.tokens_per_s, "measured": m.tokens_per_s},
                    # like with like: the estimate's tensors against the measured tensor peak; the
                    # process overhead (interpreter, CUDA context, fragmentation) apart
                    "peak_memory_bytes": {"predicted": b.memory.live_bytes, "measured": m.peak_memory_max,
                                          "predicted_overhead": b.memory.breakdown.get("overhead", 0)},
                },
            }
        return {
            "decided": self.decided, "confidence_asked": self.confidence_asked,
            "to_decide": dict(self.to_decide), "interference": dict(self.interference),
            "outcomes": trial_outcomes(self.trials),
            "stop_reason": self.stop_reason, "interrupted": self.interrupted,
            "trials_run": len({t.number for t in self.trials}), "attempts": len(self.trials),
            "candidates": len(self.plan.ranked), "enumerated": self.plan.enumerated,
            "unrunnable": dict(self.unrunnable), "confidence": self.confidence,
            "confidence_overall": self.confidence_overall, "tolerance": self.tolerance,
            "untried_to_try": self.untried_to_try,
            "untried_likeliest": None if self.untried_likeliest is None else
            {"label": self.untried_likeliest[0], "chance": self.untried_likeliest[1]},
            "learned": dict(self.learned),
            "retimed": sum(1 for t in self.trials if t.purpose == "retime"),
            "best": best, "trials": [t.to_dict() for t in self.trials],
            "memory_headroom": self.memory_headroom(),
            "out_of_memory_trials": sum(1 for t in self.trials if t.measurement.status == "oom"),
        }

    def launch_files(self, out_dir: str | Path) -> dict[str, Path]:
        """The best candidate's DeepSpeed config, hostfile, rank map and launch script."""
        from pipette.emit import write_launch_files

        if self.best is None:
            raise InfeasibleError(
                f"no trial succeeded ({self.stop_reason})", field="job",
                fix="look at the trials' errors; allow more trials or more memory headroom",
            )
        p = self.plan
        return write_launch_files(out_dir, p.model, p.training, self.best.config, p.cluster,
                                  stack=p.stack_of(self.best.config),
                                  extra={"tuning": {"stop_reason": self.stop_reason,
                                                    "best": self.to_dict()["best"]["side_by_side"]},
                                         "memory_headroom": self.memory_headroom()})

    def memory_headroom(self) -> dict[str, Any] | None:
        """How close to the device's memory the pick runs, from its trial's measured need."""
        if self.best is None:
            return None
        prior = self.plan.fits_prior or default_prior(self.plan.cluster.device_spec.kind)
        return memory_headroom(self.best.memory, prior, measured_need(self.best.memory, self.best.measurement))


#: The error of a trial the tuner stopped because it was told to (``should_stop``: Ctrl-C, SIGTERM,
#: a job's cancel); its status is ``pruned``, as Optuna counts it.
STOPPED = "cancelled"


def how_it_ended(m: Measurement) -> str:
    """A trial's status as said to a user: ``interrupted`` for one stopped from outside, which says
    nothing of its speed (it read "pruned", counted "stopped early (slower than the best)"); else
    its status."""
    return "interrupted" if m.status == "pruned" and m.error == STOPPED else m.status


def trial_outcomes(trials: Sequence[TrialRecord]) -> dict[str, int]:
    """Trials by how they ended (the last attempt of each; ``how_it_ended``), re-timing trials apart."""
    last: dict[int, TrialRecord] = {}
    for r in trials:
        if r.number not in last or r.attempt >= last[r.number].attempt:
            last[r.number] = r
    counts = Counter(("retime " if r.purpose == "retime" else "") + how_it_ended(r.measurement)
                     for r in last.values())
    return dict(sorted(counts.items()))
