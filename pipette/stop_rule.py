"""The stop rule, as Optuna's terminators: when the search stops (``StopRule``), and how far the
untried candidates are from letting it (``chance_any_beats``, ``untried_to_try``).

Stop searching when at least ``MIN_OK_TO_CONVERGE`` candidates ran ok and the untried candidates
together have less than ``stop_probability`` chance that one of them beats the pick's measured
step time by more than ``tolerance`` (and fits and runs) under the learned model, or when every
candidate still worth a trial was tried, or at the trial or time budget (the trials re-timing
keeps apart: ``pipette.retiming.RetimeBudget``), or at a failure of the user's script that no
layout explains.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipette.plan import Planned
from pipette.search import Scored
from pipette.trials import TrialRecord
from pipette.tune_options import TuneOptions

#: "converged" needs this many candidates that ran ok: with fewer the learned model has too
#: little to fit and is over-confident (replay: regret at stop fell with 3, then with 4, for one
#: more trial at the median; docs/results.md, "How the tuner got here").
MIN_OK_TO_CONVERGE = 4


@dataclass(frozen=True)
class StopRule:
    """Why a search stops now (module docstring); ``reserve``: the trials kept for re-timing."""

    options: TuneOptions
    reserve: int
    candidates: Sequence[Planned]

    def budget_spent(self, trials: int, has_pick: bool, elapsed_s: float) -> str | None:
        """The trial budget, the search's share of it (once there is a pick), or the time budget."""
        o = self.options
        if trials >= o.max_trials:
            return f"trial budget spent ({trials} trials)"
        if self.reserve and trials >= o.max_trials - self.reserve and has_pick:
            return f"search budget spent ({trials} trials; {o.max_trials - trials} kept to re-time the best)"
        if o.time_budget_s is not None and elapsed_s >= o.time_budget_s:
            return f"time budget spent ({elapsed_s:.0f} s of {o.time_budget_s:.0f} s)"
        return None

    def converged(self, ranked: Sequence[Scored], pick: str | None, measured: int) -> str | None:
        """Converged: enough candidates ran ok and the untried together are unlikely to beat the pick."""
        if pick is None or measured < min(MIN_OK_TO_CONVERGE, len(self.candidates)) or not ranked:
            return None
        o = self.options
        p_any = chance_any_beats([s.p_beat for s in ranked])
        if p_any >= o.stop_probability:
            return None
        top = max(ranked, key=lambda s: s.p_beat)
        return (f"converged: the {len(ranked)} untried candidates together have a {p_any:.1%} chance "
                f"(< {o.stop_probability:.0%}) to beat {pick} by more than {o.tolerance:.0%} "
                f"(the likeliest, {top.planned.config.label}, {top.p_beat:.1%})")

    def nothing_left(self, records: Sequence[TrialRecord]) -> str:
        """Why no candidate is left to try: all were tried, or the trials ruled the rest out (it said
        "every candidate predicted to fit was tried" when 5 of 16 were: issue 32, item 10)."""
        tried = {r.label for r in records} & {p.config.label for p in self.candidates}
        left = len(self.candidates) - len(tried)
        if left == 0:
            return f"every candidate predicted to fit was tried ({len(tried)})"
        if not tried:  # no trial of this job: the earlier jobs' trials decided (issue 43, item 25)
            return (f"no candidate is worth a trial: earlier trials on this cluster rule all {left} out (likely to "
                    "run out of memory or fail as those did); start without them (pipette tune --no-memory) to try "
                    "them anyway")
        return (f"no untried candidate is left worth a trial: {len(tried)} of {len(self.candidates)} tried; the other "
                f"{left} ruled out by what the trials taught (likely to run out of memory or fail as tried ones did)")


def script_fault(records: Sequence[TrialRecord]) -> str | None:
    """Why the search stops at a failure of the user's script that no layout explains
    (``pipette.script_faults``: a missing import, a command line it refuses, ...), with its fix;
    None when ``records`` (this run's, not a stored earlier script's) have none."""
    for r in records:
        fix = r.measurement.details.script_fault
        if fix:
            said = (r.measurement.error.splitlines() or [""])[0]
            return (f"the script failed at trial #{r.number} in a way no layout explains, so every "
                    f"candidate would ({said}); fix: {fix}")
    return None


def chance_any_beats(p_beats: Sequence[float]) -> float:
    """The chance that at least one of the untried candidates beats the incumbent, from each
    one's own chance, as if they were independent: 1 - prod(1 - p).

    The likeliest candidate's chance alone let forty candidates at 4% each pass as "converged"
    though one of them beats the pick with probability 1 - 0.96^40 = 80% (docs/results.md, "How
    the tuner got here"). The candidates' errors are correlated (one learned model), so
    independence overstates the chance: the rule errs towards another trial."""
    miss = 1.0
    for p in p_beats:
        miss *= 1.0 - min(max(p, 0.0), 1.0)
    return 1.0 - miss


@dataclass(frozen=True)
class Untried:
    """The untried candidates against the pick, each with its chance to beat it by more than the
    tolerance (and fit and run) under the learned model (``pipette.search.Scored.p_beat``)."""

    ranked: Sequence[Scored]

    def chance(self) -> float:
        """The chance that one of them beats the pick (``chance_any_beats``)."""
        return chance_any_beats([s.p_beat for s in self.ranked])

    def to_try(self, stop_probability: float) -> int:
        """How many of those likeliest to beat the pick to try before the others together have under
        ``stop_probability`` chance to (if none tried did): what to plan for, not a promise (each
        trial also teaches the model)."""
        chances = sorted((s.p_beat for s in self.ranked), reverse=True)
        k = 0
        while k < len(chances) and chance_any_beats(chances[k:]) >= stop_probability:
            k += 1
        return k

    def likeliest(self) -> tuple[str, float] | None:
        """The one likeliest to beat the pick, and that chance."""
        if not self.ranked:
            return None
        top = max(self.ranked, key=lambda s: s.p_beat)
        return top.planned.config.label, top.p_beat
