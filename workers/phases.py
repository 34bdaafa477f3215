"""Where a trial rank's wall time goes (no torch here: the first phases end before it loads)."""

from __future__ import annotations

import os
import time


class Phases:
    """Where a rank's wall time goes, in seconds per phase, from the moment its process was
    started (``PIPETTE_SPAWNED_AT``, set by whoever started it; else from ``main``):
    ``start`` (the interpreter and this module), ``imports`` (torch, DeepSpeed, transformers,
    PEFT; near 0 for a rank forked from the warm zygote), ``rendezvous`` (the process group),
    ``ops`` (DeepSpeed's JIT-built ops, ``workers.ops``, and its communication; near 0 once built),
    ``build`` (the model, adapters, pipeline stage and shards), ``engine``
    (``deepspeed.initialize``), ``warmup`` and ``steps`` (the timed steps), ``end``."""

    def __init__(self) -> None:
        self.last = time.time()
        self.seconds: dict[str, float] = {}

    def begin(self) -> None:
        """Start counting from the process's start (a rank forked from the zygote inherits
        this object as the zygote left it)."""
        spawned = os.environ.get("PIPETTE_SPAWNED_AT")
        self.last = float(spawned) if spawned else time.time()
        self.seconds = {}

    def current(self) -> str:
        """The phase running now: the one after the last marked."""
        order = ("start", "imports", "rendezvous", "ops", "build", "engine", "warmup", "steps", "end")
        done = [p for p in order if p in self.seconds]
        return order[min(order.index(done[-1]) + 1, len(order) - 1)] if done else order[0]

    def mark(self, phase: str) -> None:
        now = time.time()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + max(0.0, now - self.last)
        self.last = now


#: this process's phases (``workers.train`` marks the first ones before the trial starts)
PHASES = Phases()
