"""Where a trial rank's wall time goes (no torch here: the first phases end before it loads)."""

from __future__ import annotations

import os
import sys
import time

from pipette.contract import event_line

#: a rank's phases, in the order it runs them
ORDER = ("start", "imports", "rendezvous", "ops", "build", "engine", "warmup", "steps", "end")
#: each phase as the lines users read name it
WORDS = {
    "start": "start-up", "imports": "imports (torch, DeepSpeed, transformers)", "rendezvous": "rendezvous",
    "ops": "op build (DeepSpeed's CPU op)", "build": "model build",
    "engine": "engine set-up (deepspeed.initialize; FSDP: optimizer and pipeline schedule)",
    "warmup": "warm-up steps", "steps": "timed steps",
    "end": "end",
}


def earliest(phases: list[str]) -> str | None:
    """The phase furthest behind (the one holding a trial up), None for none."""
    known = [p for p in phases if p in ORDER]
    return min(known, key=ORDER.index) if known else None


def timeout_text(timeout_s: float, phase: str | None, last_step: int | None) -> str:
    """What a timed-out trial of Pipette's runner tells the user: where it was, and the fix
    (first line short enough for a trial's line of ``pipette tune``)."""
    where = f" in its {WORDS.get(phase, phase)}" if phase else ""
    steps = f" after step {last_step}" if last_step is not None else " before its first step"
    return f"timed out after {timeout_s:g} s{where}{steps}: give it more time with --trial-timeout {2 * timeout_s:g}"


def script_timeout_text(timeout_s: float, said: str) -> str:
    """What a script trial that reported no step before its timeout tells the user: the fix
    first (a trial's line of ``pipette tune`` shows the start), then what else it may be."""
    last = f"; its last line: {said[:300]}" if said else "; it printed nothing"
    return (f"no step reported in {timeout_s:g} s: if it is still starting (imports, loading the model), give it "
            f"more time with --trial-timeout {2 * timeout_s:g}; else it hangs, or it neither reports through "
            f"pipette.report nor trains through a DeepSpeed engine{last}")


class Phases:
    """Where a rank's wall time goes, in seconds per phase, from the moment its process was
    started (``PIPETTE_SPAWNED_AT``, set by whoever started it; else from ``main``):
    ``start`` (the interpreter and this module), ``imports`` (torch, DeepSpeed, transformers,
    PEFT; near 0 for a rank forked from the warm zygote), ``rendezvous`` (the process group),
    ``ops`` (DeepSpeed's JIT-built ops, ``workers.ops``, and its communication; near 0 once built),
    ``build`` (the model, adapters, pipeline stage and shards), ``engine``
    (``deepspeed.initialize``), ``warmup`` and ``steps`` (the timed steps), ``end``.

    Each phase the rank enters is said on stdout (a ``phase`` event), so whoever runs the rank
    can name the phase a timeout or a crash caught it in."""

    def __init__(self) -> None:
        self.last = time.time()
        self.seconds: dict[str, float] = {}
        self.said = ""
        self.then: str | None = None

    def begin(self) -> None:
        """Start counting from the process's start (a rank forked from the zygote inherits
        this object as the zygote left it)."""
        spawned = os.environ.get("PIPETTE_SPAWNED_AT")
        self.last = float(spawned) if spawned else time.time()
        self.seconds = {}
        self.said = ""
        self.then = None
        self._say()

    def current(self) -> str:
        """The phase running now: the one ``mark`` said comes next, else the one after the last
        marked; the steps (warm-up, timed) repeat until the end is marked."""
        done = [p for p in ORDER if p in self.seconds]
        if not done:
            return ORDER[0]
        if self.then is not None and done[-1] != "end":
            return self.then
        if done[-1] in ("warmup", "steps"):
            return done[-1]
        return ORDER[min(ORDER.index(done[-1]) + 1, len(ORDER) - 1)]

    def mark(self, phase: str, then: str | None = None) -> None:
        """``phase`` ended now; ``then``: the phase that runs next, where it is not the usual."""
        now = time.time()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + max(0.0, now - self.last)
        self.last = now
        self.then = then
        self._say()

    def _say(self) -> None:
        now = self.current()
        if now != self.said:
            self.said = now
            sys.stdout.write(event_line({"event": "phase", "phase": now}))
            sys.stdout.flush()


#: this process's phases (``workers.rank.train`` marks the first ones before the trial starts)
PHASES = Phases()
