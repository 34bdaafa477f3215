"""The tuning options, declared once.

Each ``Option`` is one knob of a tuning job (the trial budget, the stop rule, the re-timing,
the trials' length) or of a plan, with its type, default, help and bounds. Everything else is
generated from ``OPTIONS``: the flags of ``pipette tune``, ``pipette plan`` and ``pipette
submit`` (``cli.inputs``), the API's ``budget`` and plan fields (``service.schemas``),
and the defaults and checks of ``pipette.tuner.TuneOptions``. An option's ``scopes`` say where
it applies: ``tune`` (a tuning job: ``pipette tune``, a job's ``budget``) and ``plan`` (``pipette
plan``, ``POST /v1/plan``).

Bounds are of two kinds: ``ge``/``gt``/``le``/``lt`` are what the value means (a fraction is
below 1), checked everywhere; ``cap`` is the shared service's limit on a job (at most 500
trials), checked by the API only: a local run may go past it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pipette.errors import SpecError

Value = int | float | bool | None
Scope = Literal["tune", "plan"]

#: A trial's wall-clock limit when its job gives none (``trial_timeout_s``); the service's
#: operator may set another (``PIPETTE_TRIAL_TIMEOUT_S``).
TRIAL_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Option:
    name: str
    kind: type[int] | type[float] | type[bool]
    default: Value
    #: what it does, naming other options as ``{max_trials}`` (each side writes its own form)
    help: str
    scopes: tuple[Scope, ...] = ("tune",)
    #: the CLI flag without ``--`` (default: the name with dashes)
    flag: str = ""
    #: what None means, for an option whose default is None
    unset: str = ""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    #: the service's upper limit (inclusive), beyond the meaning's bounds
    cap: float | None = None

    @property
    def cli_flag(self) -> str:
        return "--" + (self.flag or self.name.replace("_", "-"))

    @property
    def optional(self) -> bool:
        return self.default is None

    def default_text(self) -> str:
        if self.default is None:
            return f"default: {self.unset}"
        if isinstance(self.default, bool):
            return f"default: {'on' if self.default else 'off'}"
        return f"default {self.default:g}"

    def fix(self) -> str:
        """How to give a good value, from the meaning's bounds."""
        if self.kind is bool:
            return "give true or false"
        example = "" if self.default is None else f", e.g. {self.default:g}"
        if self.kind is int:
            first = int(self.ge) if self.ge is not None else int(self.gt or 0) + 1
            span = f"from {first} to {int(self.le)}" if self.le is not None else f"of {first} or more"
            return f"give a whole number {span}{example}"
        left, low = ("[", self.ge) if self.ge is not None else ("(", self.gt or 0.0)
        if self.le is None and self.lt is None:
            return f"give a number {'above' if left == '(' else 'of at least'} {low:g}{example}"
        right, high = ("]", self.le) if self.le is not None else (")", self.lt or 0.0)
        return f"give a number in {left}{low:g}, {high:g}{right}{example}"

    def check(self, value: object, field: str, *, said: str | None = None) -> Value:
        """``value`` if it is of this option's type and within its meaning's bounds, else a
        ``SpecError`` naming ``field`` (and the value as ``said``, the words it was given in).
        An int stands for a float."""
        if value is None and self.optional:
            return None
        shown = repr(value) if said is None else said
        if self.kind is bool:
            if not isinstance(value, bool):
                raise SpecError(f"is {shown}", field=field, fix=self.fix())
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or \
                (self.kind is int and not isinstance(value, int)):
            raise SpecError(f"is {shown}, not a {'whole ' if self.kind is int else ''}number", field=field,
                            fix=self.fix())
        number = self.kind(value)
        if not self._within(number):
            raise SpecError(f"is {value if said is None else said}", field=field, fix=self.fix())
        return number

    def parse(self, text: str, field: str) -> Value:
        """A command-line word as this option's value (then ``check``)."""
        try:
            value: Value = int(text) if self.kind is int else float(text)
        except ValueError:
            raise SpecError(f"is {text!r}, not a {'whole ' if self.kind is int else ''}number", field=field,
                            fix=self.fix()) from None
        return self.check(value, field, said=text)

    def _within(self, x: float) -> bool:
        return not math.isnan(x) and (self.ge is None or x >= self.ge) and (self.gt is None or x > self.gt) \
            and (self.le is None or x <= self.le) and (self.lt is None or x < self.lt)


OPTIONS: tuple[Option, ...] = (
    Option("max_trials", int, 8, "trials at most, re-timing included", ge=1, cap=500),
    Option("time_budget_s", float, None, "seconds of trials at most, over all attempts of the job",
           flag="time-budget", unset="no limit", gt=0, cap=30 * 86400),
    Option("tolerance", float, 0.02, "stop when no untried candidate is likely to beat the best by more than this "
           "fraction", ge=0.0, lt=1.0),
    Option("stop_probability", float, 0.05, "...with more than this chance", ge=0.0, lt=1.0),
    Option("prune", bool, True, "stop a trial early when it is clearly slower than the best"),
    Option("prune_slower", float, 0.25, "how much slower counts as clearly (a fraction)", ge=0.0, lt=1.0),
    Option("retries", int, 1, "retries of a failed or timed-out candidate (each a later trial)", ge=0, cap=5),
    Option("seed", int, 0, "seed of the search and of the trials' data", ge=0, le=2**31 - 1),
    Option("retime", int, 3, "before the verdict, re-time the best this many candidates, interleaved "
           "(0: do not); {reserve} trials of {max_trials} are kept for it", ge=0, cap=10),
    Option("retime_rounds", int, 3, "re-timing rounds at most", ge=0, cap=10),
    Option("reserve", int, None, "trials of {max_trials} kept for re-timing, fewer than {max_trials}; on a noisy "
           "machine keep {retime} x {retime_rounds}", unset="a quarter of {max_trials}, at least 2, at most one "
           "round of {retime}; on CPU devices two rounds or more where {max_trials} allows: of {retime} in up to "
           "0.4 of it, else of 2 in up to half of it",
           ge=0, cap=499),
    Option("confidence", float, 0.9, "stop re-timing once the pick is this sure to be within {tolerance} of the "
           "best tried", gt=0.0, lt=1.0),
    Option("steps", int, 8, "timed steps per trial at most", ge=1, cap=1000),
    Option("trial_timeout_s", float, None, "seconds before a trial is a timeout", flag="trial-timeout",
           unset=f"{TRIAL_TIMEOUT_S:g} s; on the service, PIPETTE_TRIAL_TIMEOUT_S, which its operator sets",
           gt=0, cap=86400),
    Option("margin", float, None, "device memory to keep free, as a fraction of the predicted peak",
           scopes=("tune", "plan"), unset="0, as the chance to fit already prices the estimator's error",
           ge=0.0, lt=1.0),
    Option("top", int, 10, "how many ranked candidates to show", scopes=("plan",), ge=1, cap=1000),
)
BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}


def options_for(scope: Scope) -> tuple[Option, ...]:
    return tuple(o for o in OPTIONS if scope in o.scopes)


def defaults(scope: Scope) -> dict[str, Value]:
    return {o.name: o.default for o in options_for(scope)}


def default(name: str) -> Value:
    return BY_NAME[name].default


def describe(option: Option, names: Mapping[str, str]) -> tuple[str, str]:
    """``option``'s help and its default's words, other options named as ``names`` says (a
    flag on the command line, a field in the API)."""
    return option.help.format(**names), option.default_text().format(**names)


def check_values(values: Mapping[str, object], field: str = "budget.{name}") -> dict[str, Value]:
    """Every option in ``values`` checked (``Option.check``), an error naming ``field``
    formatted with the option's ``name`` or ``flag``."""
    return {name: BY_NAME[name].check(value, field.format(name=name, flag=BY_NAME[name].cli_flag))
            for name, value in values.items()}
