"""Re-timing before the verdict: how many trials it keeps from the search (``RetimeBudget``), which
candidates it runs again (``contenders``) and in what order (``round_order``).

Before the tuner hands back its pick, it and the ``retime`` - 1 candidates tried so far that it is
least sure to be within ``tolerance`` of are run again, interleaved (each round runs every contender
once, in alternating order, so that drift on the machine hits them alike), until the pick is within
``tolerance`` of every contender with probability ``confidence`` or the rounds or the budget run
out. When the repeats show more trial-to-trial noise than the stop rule assumed, an untried
candidate may have a chance again: the search goes on, and re-times again before it stops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipette.tune_options import TuneOptions
from pipette.verdict import Tried

#: the most of a CPU job's budget ``RetimeBudget.noisy_rounds`` keeps for re-timing rounds
NOISY_RESERVE_SHARE = 0.4


@dataclass(frozen=True)
class RetimeBudget:
    """The trials re-timing keeps from the search, and its rounds, for trials on one kind of device."""

    options: TuneOptions
    device_kind: str

    @property
    def default_reserve(self) -> int:
        """Trials kept on a GPU: ``reserve`` when given, else a quarter of the budget, at least 2
        and at most one round (``retime``). A larger reserve costs the search (replay, trial noise
        2%: docs/results.md, "Evidence behind the tuner's constants"); on a noisy machine ``noisy_rounds`` gives the
        rounds room instead, and ``TuneOptions.for_search`` puts them on top."""
        o = self.options
        if o.retime < 2 or o.retime_rounds < 1:
            return 0
        if o.reserve is not None:
            return o.reserve
        if o.max_trials < 4:
            return 0
        return min(o.retime, max(2, o.max_trials // 4))

    @property
    def reserve(self) -> int:
        """``default_reserve``, or the rounds ``noisy_rounds`` keeps where they are more."""
        size, rounds = self.noisy_rounds
        return max(self.default_reserve, size * rounds)

    @property
    def round_size(self) -> int:
        """Contenders a re-timing round takes at most (the pick among them)."""
        size, rounds = self.noisy_rounds
        return size if rounds else self.options.retime

    @property
    def noisy_rounds(self) -> tuple[int, int]:
        """(contenders a round, rounds) kept on CPU devices, (0, 0) where ``default_reserve`` is kept
        (a GPU, a given ``reserve``, no re-timing). CPU trials share cores with the host and spread
        ~8% from run to run (GPU ~2%): one round cannot order candidates a few percent apart, so
        whole rounds of ``retime`` in up to ``NOISY_RESERVE_SHARE`` of the budget where that makes
        two rounds or more, else two rounds or more of the pick and one contender in up to half of
        it (budgets of 8 to 14); the replays behind both: docs/results.md, "A CPU job keeps whole re-timing
        rounds" and "Smaller CPU budgets keep two rounds of two"."""
        o = self.options
        if self.device_kind != "cpu" or o.reserve is not None or self.default_reserve == 0:
            return 0, 0
        rounds = min(o.retime_rounds, int(NOISY_RESERVE_SHARE * o.max_trials) // o.retime)
        if rounds >= 2:
            return o.retime, rounds
        pairs = min(o.retime_rounds, o.max_trials // 2 // 2)
        return (2, pairs) if pairs >= 2 else (0, 0)


def contenders(tried: Tried | None, options: TuneOptions) -> list[str]:
    """The pick and the candidates to re-time it against, ``retime`` at most. Until the pick was
    timed twice: the pick, and every candidate within ``prune_slower`` of it (the noise is not
    measured yet: the prior may be over-confident); then those it is not yet ``confidence`` sure to
    be within the tolerance of, and those that may be faster than it (a chance of 1 - ``confidence``
    or more, by their trials alone or weighed with the model's prediction of them,
    ``Tried.faster_as_predicted``: CI's shaped-cluster job once never re-timed the best candidate
    after its one trial ran 18% slow). Either way those timed fewest first (each contender timed
    again before any a third time: rounds of the pick and one other once re-timed the same
    runner-up twice and never the best, whose one trial had run 12% slow), then the least sure,
    then the best mean: a candidate timed once, as slow as one timed twice, is the likelier to beat
    the pick (by mean alone, a real CPU run never re-timed the best candidate after its one trial
    ran 26% slow)."""
    if tried is None or options.retime < 2:
        return []
    means, pick = tried.means, tried.pick
    mp, n_p = means[pick]
    sure = tried.within()
    if n_p == 1:
        near = -math.log(1.0 - options.prune_slower) if options.prune_slower > 0 else math.inf
        others = [k for k, (m, _) in means.items() if k != pick and m - mp < near]
    else:
        # Sure to be within 2% of a candidate 1% faster, re-timing once stopped and handed over the
        # slower one (docs/results.md, "Evidence behind the tuner's constants"): the faster-at-all count too.
        faster, as_predicted = tried.faster(), tried.faster_as_predicted()
        others = [k for k, p in sure.items()
                  if p < options.confidence or max(faster[k], as_predicted[k]) >= 1.0 - options.confidence]
    others.sort(key=lambda k: (means[k][1], sure[k], means[k][0], k))
    if n_p == 1 or others:  # timed once, the pick is re-timed alone too: its repeat measures the noise
        return [pick, *others[: options.retime - 1]]
    return []


def round_order(first_seen: list[str], round_: list[str], rounds_done: int) -> list[str]:
    """A round's order: each contender keeps the place it first ran at (``first_seen``, extended
    here), the order reversed every other round so that drift on the machine hits them alike."""
    first_seen += [c for c in round_ if c not in first_seen]
    ordered = [c for c in first_seen if c in round_]
    return ordered if rounds_done % 2 == 0 else ordered[::-1]
