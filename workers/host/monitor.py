"""The one loop that watches a run's ranks and decides how it ended.

Event lines, exit codes and the clock in; an ``Outcome`` out (``ok``, ``oom``, ``failed``,
``timeout``, ``pruned``), whatever the transport (Ray or local) and whatever the ranks run (a
kind of run, ``workers.host.kinds``: Pipette's runner, a user's script, the probe). The kind
reads the events and says when its ranks are done; the monitor owns what is common: phases,
step relays, cancellation, lost nodes, a rank's failed exit and its root cause, the timeout.
"""

from __future__ import annotations

import json
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from workers.host.outcome import Outcome
from workers.host.transport import Launch, Polled, Transport, start_ranks
from workers.phases import WORDS, earliest

#: how a run stopped by ``should_stop`` reads (the tuner and the service look for "cancel")
CANCELLED = "cancelled"
#: how often ``OnPhase`` hears the elapsed time while the phase stays
PHASE_TICK_S = 1.0
#: the characters of a failed trial's output kept in its record
OUTPUT_TAIL_CHARS = 4000
#: whether a kind's ranks are done: yes, not yet, or done but given a moment to exit
Finished = Literal["yes", "no", "wait"]


@dataclass(frozen=True)
class StepReport:
    """One step of rank 0, as it happens."""

    step: int
    time: float
    loss: float
    warmup: bool
    #: seconds since the run's processes started
    elapsed: float
    #: process id of each rank, on its node
    pids: tuple[int, ...]


#: Called after every step; returning True prunes the run (stopped within a poll interval).
OnStep = Callable[[StepReport], bool | None]
#: Called with the phase the ranks are in (the one furthest behind: ``workers.phases``) and
#: the seconds since they started, when it changes and about once a second.
OnPhase = Callable[[str, float], None]


class RunKind(Protocol):
    """What one kind of run reads from its ranks' events (``workers.host.kinds``)."""

    world: int

    def launch(self, transport: Transport) -> Launch: ...

    def take(self, rank: int, event: dict[str, Any]) -> dict[str, Any] | None:
        """Keep ``event``; rank 0's step to relay to ``OnStep`` (once per step), else None."""
        ...

    def failure(self) -> Outcome | None:
        """How the run failed by what its ranks said (out of memory, a config ignored), if it did."""
        ...

    def ended(self, rank: int) -> bool:
        """The rank reported its end: its exit, even by a signal, fails nothing."""
        ...

    def finished(self, codes: dict[int, int]) -> Finished: ...

    def exit_failure(self, head: str, tail: str) -> Outcome | None:
        """What a rank's failed exit means when the kind knows better than "failed"."""
        ...

    def all_exited(self) -> Outcome:
        """Every rank exited cleanly without ``finished`` saying yes."""
        ...

    def timed_out(self, timeout_s: float, behind: str | None, last_step: int | None,
                  tail: Callable[[], str]) -> Outcome: ...


@dataclass(frozen=True)
class Watched:
    """How a run ended: its outcome, its wall time since its ranks started, the output of the
    rank whose exit failed it (empty where it ended otherwise), the ranks' process ids."""

    outcome: Outcome
    wall: float
    exit_tail: str
    pids: tuple[int, ...]


def run_ranks(transport: Transport, kind: RunKind, timeout_s: float, *, extra_env: dict[str, str] | None = None,
              on_step: OnStep | None = None, should_stop: Callable[[], bool] | None = None,
              on_phase: OnPhase | None = None) -> Watched:
    """Launch ``kind``'s ranks on ``transport``, watch them to their end, and say how it went.
    The caller closes the transport (which ends every rank)."""
    stop = should_stop or (lambda: False)
    launch = kind.launch(transport)
    if not transport.prepare(launch, stop):
        return Watched(Outcome("pruned", f"{CANCELLED} before its ranks started"), 0.0, "", ())
    pids = start_ranks(transport, launch, extra_env or {})
    return Monitor(transport, kind, timeout_s, on_step, stop, on_phase, pids).run()


class Monitor:
    def __init__(self, transport: Transport, kind: RunKind, timeout_s: float, on_step: OnStep | None,
                 should_stop: Callable[[], bool], on_phase: OnPhase | None, pids: tuple[int, ...]) -> None:
        self.t, self.kind, self.timeout_s = transport, kind, timeout_s
        self.on_step, self.should_stop, self.pids = on_step, should_stop, pids
        self.phases = RankPhases(kind.world, on_phase)
        self.codes: dict[int, int] = {}
        self.last_step: int | None = None
        self.exit_tail = ""
        self.start = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def run(self) -> Watched:
        outcome: Outcome | None = None
        while outcome is None:
            outcome = self.turn()
        return Watched(outcome, self.elapsed(), self.exit_tail, self.pids)

    def turn(self) -> Outcome | None:
        """One poll of the ranks: the run's outcome once it has one."""
        if self.should_stop():
            return Outcome("pruned", f"{CANCELLED} {self.elapsed():.0f} s in (last step of rank 0: {self.last_step})")
        polled, lost = self.t.poll()
        if lost:
            rank, why = min(lost.items())
            return Outcome("failed", f"{self.t.where(rank)} was lost: {why}", lost=self.t.hosts(sorted(lost)))
        pruned = self.read(polled, relay=True)
        if pruned is not None:
            return pruned
        self.phases.tick(self.elapsed())
        return self.decide()

    def read(self, polled: Polled, relay: bool) -> Outcome | None:
        """Hand every new event to the kind and keep the exits; a pruning ``OnStep`` says stop."""
        pruned = None
        for rank, (lines, code) in enumerate(polled):
            for line in lines:
                event = json.loads(line)
                if event.get("event") == "phase":
                    self.phases.enter(rank, str(event["phase"]), self.elapsed())
                    continue
                step = self.kind.take(rank, event)
                if step is not None and relay:
                    pruned = pruned or self.relay(step)
            if code is not None:
                self.codes[rank] = code
        return pruned

    def relay(self, step: dict[str, Any]) -> Outcome | None:
        self.last_step = int(step["step"])
        loss = step.get("loss")
        report = StepReport(self.last_step, float(step["time"]), math.nan if loss is None else float(loss),
                            bool(step.get("warmup")), self.elapsed(), self.pids)
        if self.on_step is not None and self.on_step(report):
            return Outcome("pruned", f"pruned by the caller after step {report.step}")
        return None

    def decide(self) -> Outcome | None:
        """The outcome the ranks' events and exits so far give, else None (after a poll's pause)."""
        failure = self.kind.failure()
        if failure is not None:
            return failure
        finished = self.kind.finished(self.codes)
        if finished == "yes":
            return Outcome("ok")
        if finished == "no":
            if any(c != 0 and not self.kind.ended(r) for r, c in self.codes.items()):
                return self.failed_exit()
            if len(self.codes) == self.kind.world:
                return self.kind.all_exited()
            if self.elapsed() > self.timeout_s:
                return self.kind.timed_out(self.timeout_s, self.phases.behind(), self.last_step,
                                           lambda: self.t.output_tail(0))
        time.sleep(self.t.poll_s)
        return None

    def failed_exit(self) -> Outcome:
        """A rank exited non-zero before its end: out of memory (its own report, or the kind's
        reading of its output), else failed, naming the rank whose exit explains it."""
        time.sleep(0.5)  # the other ranks' last lines (an oom report) and exits
        self.read(self.t.poll()[0], relay=False)
        failure = self.kind.failure()
        if failure is not None:
            return failure
        rank, code = root_cause({r: c for r, c in self.codes.items() if not self.kind.ended(r)})
        tail = self.exit_tail = self.t.output_tail(rank)
        head = f"{self.t.where(rank)} {exit_text(code)}{self.phases.during(rank)}"
        known = self.kind.exit_failure(head, tail)
        if known is not None:
            return known
        gone = self.t.unreachable()
        if gone:  # the cause: a lost node; the exit is its consequence
            head = f"{', '.join(self.t.where(r) for r in gone)} became unreachable (node down?); then {head}"
        return Outcome("failed", f"{head}\n{tail[-OUTPUT_TAIL_CHARS:]}", lost=self.t.hosts(gone),
                       phase=self.phases.of.get(rank))


class RankPhases:
    """The phase each rank is in (its ``phase`` events), told to ``on_phase`` as it changes."""

    def __init__(self, world: int, on_phase: OnPhase | None) -> None:
        self.of: dict[int, str] = {}
        self.world, self.on_phase = world, on_phase
        self.told: tuple[str, float] | None = None

    def enter(self, rank: int, phase: str, elapsed: float) -> None:
        """Keep ``rank``'s phase; tell each phase the slowest rank enters, even one it leaves
        before the next poll (a short trial's ranks pass through several within one)."""
        self.of[rank] = phase
        self.tick(elapsed)

    def behind(self) -> str | None:
        """The phase of the rank furthest behind (a rank not heard from yet: ``start``)."""
        return earliest([self.of.get(r, "start") for r in range(self.world)]) if self.of else None

    def during(self, rank: int) -> str:
        """" in its <phase>" for a line about ``rank`` (empty when it said none)."""
        phase = self.of.get(rank)
        return f" in its {WORDS.get(phase, phase)}" if phase else ""

    def tick(self, elapsed: float) -> None:
        phase = self.behind() or "start"
        if self.on_phase is None:
            return
        if self.told is None or self.told[0] != phase or elapsed - self.told[1] >= PHASE_TICK_S:
            self.told = (phase, elapsed)
            self.on_phase(phase, elapsed)


def root_cause(codes: dict[int, int]) -> tuple[int, int]:
    """The rank whose exit explains the failure: one killed by a signal first (its peers then
    fail on the broken collective, often before its own exit is seen), else the lowest rank
    that exited non-zero."""
    failed = sorted((r, c) for r, c in codes.items() if c != 0)
    return next(((r, c) for r, c in failed if c < 0), failed[0])


def exit_text(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"
