"""How sure the pick is: the tried candidates against it under the measured trial-to-trial noise
(``Tried``), and the verdict said at the end of a search (``verdict``).

The pick is the candidate with the best mean log step time over its ok trials. ``Tried.confidence``
is the probability that it is within ``tolerance`` of the best candidate tried; that noise is itself
estimated from few repeats, so the difference of two means is Student-t, not normal, while the
repeats are few (``Tried.within``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from scipy.stats import t as student_t

from pipette.trials import TrialRecord

#: beyond this many more trials of each, ``Tried.trials_to_decide`` says none would decide
MAX_TRIALS_TO_DECIDE = 50


@dataclass(frozen=True)
class Tried:
    """The tried candidates against the pick: their mean log step times and trial counts
    (``pipette.search.measured_means``), the measured trial-to-trial noise (log sd) and its
    degrees of freedom (``learned.trial_noise``, the prior's included)."""

    pick: str
    means: Mapping[str, tuple[float, int]]
    noise_sd: float
    dof: float
    tolerance: float
    #: per tried candidate, the learned model's log step time and its sd when its first trial was proposed
    predicted: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def gaps(self) -> dict[str, tuple[float, float]]:
        """Per other tried candidate: its mean log step time minus the pick's, and the standard
        error of that difference under the measured noise."""
        mp, n_p = self.means[self.pick]
        return {label: (m - mp, self.noise_sd * math.sqrt(1.0 / n_p + 1.0 / n))
                for label, (m, n) in self.means.items() if label != self.pick}

    def posterior(self, label: str) -> tuple[float, float]:
        """A tried candidate's log step time (mean, variance): its trials' mean weighed with what the
        model predicted of it before its first trial (``predicted``; a normal prior and normal
        measurements: the precision-weighted mean, Gelman et al., *Bayesian Data Analysis*, 3rd ed.,
        sec. 2.5); its trials alone where no prediction was kept."""
        m, n = self.means[label]
        var_n = self.noise_sd**2
        mu, sd = self.predicted.get(label, (0.0, 0.0))
        if sd <= 0:
            return m, var_n / n
        w_prior, w_trials = 1.0 / sd**2, n / var_n
        return (w_prior * mu + w_trials * m) / (w_prior + w_trials), 1.0 / (w_prior + w_trials)

    def within(self) -> dict[str, float]:
        """Per other tried candidate: the probability that the pick is within the tolerance of it
        (its mean log step time less than ``log(1 + tolerance)`` above the other's). The noise's
        posterior (a scaled inverse-chi^2) makes the difference of two means Student-t (Gelman et
        al., *Bayesian Data Analysis*, 3rd ed., sec. 3.2), heavier-tailed while repeats are few."""
        margin = math.log(1.0 + self.tolerance)
        return {label: float(student_t.cdf((gap + margin) / se, self.dof)) for label, (gap, se) in self.gaps().items()}

    def faster(self) -> dict[str, float]:
        """Per other tried candidate: the probability that it is faster than the pick at all."""
        return {label: float(student_t.cdf(-gap / se, self.dof)) for label, (gap, se) in self.gaps().items()}

    def faster_as_predicted(self) -> dict[str, float]:
        """Per other tried candidate: the chance that it is faster than the pick at all, its trials'
        mean weighed with what the model predicted of it before its first trial (``posterior``).
        One slow trial of a candidate the model put ahead of the pick is either a slow run of the
        machine or the model wrong; a second trial tells which."""
        mp, n_p = self.means[self.pick]
        out: dict[str, float] = {}
        for label in self.means:
            if label != self.pick:
                mean, var = self.posterior(label)
                se = math.sqrt(var + self.noise_sd**2 / n_p)
                out[label] = float(student_t.cdf((mp - mean) / se, self.dof))
        return out

    def confidence(self) -> float:
        """Probability that the pick is within the tolerance of the best candidate tried."""
        return math.prod(self.within().values())

    def trials_to_decide(self, confidence: float) -> dict[str, int | None]:
        """Per tried candidate the pick is not yet ``confidence`` sure against: how many more trials
        of each (the pick and it alike) would make it so, if the means and the noise stay as
        measured (the standard error shrinking as sqrt(1/n_p + 1/n)); None when no number would:
        its mean is the faster by more than the tolerance, so more trials would move the pick."""
        quantile = float(student_t.ppf(confidence, self.dof))
        mp, n_p = self.means[self.pick]
        out: dict[str, int | None] = {}
        for label, sure in self.within().items():
            if sure >= confidence:
                continue
            m, n = self.means[label]
            margin = m + math.log(1.0 + self.tolerance) - mp
            k = 0
            while margin > 0 and k <= MAX_TRIALS_TO_DECIDE and \
                    self.noise_sd * math.sqrt(1.0 / (n_p + k) + 1.0 / (n + k)) * quantile > margin:
                k += 1
            out[label] = k if margin > 0 and k <= MAX_TRIALS_TO_DECIDE else None
        return out


def first_predictions(records: Sequence[TrialRecord]) -> dict[str, tuple[float, float]]:
    """Per candidate, the learned model's log step time and its sd for its first trial: what the
    model said of it before it measured any (``Tried.predicted``)."""
    out: dict[str, tuple[float, float]] = {}
    for r in records:
        if r.predicted_step_time > 0:
            out.setdefault(r.label, (math.log(r.predicted_step_time), r.predicted_sd))
    return out


def pick(records: Sequence[TrialRecord], means: Mapping[str, tuple[float, int]]) -> TrialRecord | None:
    """The pick: the candidate with the best mean log step time over its ok trials (``means``), its
    trial with the median step time standing for it; None before an ok trial."""
    if not means:
        return None
    label = min(means, key=lambda k: (means[k][0], k))
    ok = sorted((r for r in records if r.label == label and r.measurement.status == "ok" and r.measurement.step_time),
                key=lambda r: (r.measurement.step_time or math.inf, r.number))
    return ok[(len(ok) - 1) // 2]


def verdict(reason: str, tried: Tried | None, retimed: int, rounds: int) -> str:
    """The stop reason with the verdict on the pick: how sure it is, and the re-timing behind it
    (``retimed`` contenders in ``rounds`` rounds, over every re-timing of the job)."""
    if tried is None:
        return reason
    said = (f"pick {tried.pick}, {tried.confidence():.0%} sure to be within {tried.tolerance:.0%} "
            "of the best tried")
    if len(tried.means) == 1:  # a certainty of 1 over nothing compared (issue 43, item 29)
        said = (f"pick {tried.pick}, the only candidate that ran ok: no other measured to compare it with, "
                "so how close it is to the best is not known")
    if retimed:
        rounds_text = f" in {rounds} round(s)" if rounds else ""
        said = f"re-timed {retimed} contenders{rounds_text}: " + said
    return f"{reason}; {said}"
