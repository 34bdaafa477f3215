"""The search's options (``TuneOptions``): budgets, the stop rule's thresholds, pruning, retries
and re-timing. Their defaults, bounds and help live in ``pipette.options``; how re-timing spends
its share of the budget is ``pipette.retiming.RetimeBudget``'s."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar, cast

from pipette.errors import SpecError
from pipette.options import check_values, default

T = TypeVar("T")


def _option(name: str, kind: type[T]) -> T:
    """The default of option ``name`` (``pipette.options``) as a field of ``kind`` (None: unset)."""
    value = default(name)
    if value is not None and type(value) is not kind:
        raise TypeError(f"option {name} defaults to {value!r}, not a {kind.__name__}")
    return cast(T, value)


@dataclass(frozen=True)
class TuneOptions:
    """The search's options; their defaults, bounds and help are ``pipette.options``'."""

    max_trials: int = _option("max_trials", int)
    time_budget_s: float | None = _option("time_budget_s", float)
    tolerance: float = _option("tolerance", float)
    stop_probability: float = _option("stop_probability", float)
    prune: bool = _option("prune", bool)
    #: prune when even the trial's best step is this much slower than the incumbent
    prune_slower: float = _option("prune_slower", float)
    retries: int = _option("retries", int)
    seed: int = _option("seed", int)
    #: contenders re-timed before the verdict (0 or 1: no re-timing), and at most this many rounds
    retime: int = _option("retime", int)
    retime_rounds: int = _option("retime_rounds", int)
    #: stop re-timing once the pick is this sure to be within ``tolerance`` of the best tried
    confidence: float = _option("confidence", float)
    #: trials kept from the search for re-timing (None: ``RetimeBudget``'s default)
    reserve: int | None = _option("reserve", int)

    def __post_init__(self) -> None:
        check_values({f.name: getattr(self, f.name) for f in fields(self)})
        if self.reserve is not None and not self.reserve < self.max_trials:
            raise SpecError(f"is {self.reserve} of max_trials {self.max_trials}", field="budget.reserve",
                            fix=f"keep 0 to {self.max_trials - 1} trials for re-timing (the rest search), "
                                "or raise max_trials")

    @classmethod
    def from_values(cls, values: Mapping[str, object]) -> TuneOptions:
        """The search's options among ``values`` (a job's budget, the command line's options);
        the others (``steps``, ``margin``, ...) are the runner's and the plan's."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})  # type: ignore[arg-type]  # __post_init__ checks

    @classmethod
    def for_search(cls, search_trials: int, **kwargs: Any) -> TuneOptions:
        """Options for a search of ``search_trials`` trials with every re-timing round on top
        (``retime`` x ``retime_rounds`` trials): the budget of a benchmark that counts the
        candidates tried, on a machine whose trial-to-trial noise needs the rounds."""
        probe = cls(**kwargs)
        reserve = probe.retime * probe.retime_rounds if probe.retime >= 2 else 0
        return cls(max_trials=search_trials + reserve, reserve=reserve, **kwargs)
