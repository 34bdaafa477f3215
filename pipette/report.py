"""``pipette.report``: how a user's own training script tells Pipette what each step took.

Dependency-free (the standard library only), so any training loop can use it::

    from pipette.report import Reporter

    reporter = Reporter()
    for batch in loader:
        loss = engine(batch); engine.backward(loss); engine.step()
        if reporter.step(loss=float(loss), samples=engine.train_batch_size()):
            break                      # Pipette has timed enough steps
    reporter.done()

and Hugging Face's ``Trainer`` takes ``Trainer(..., callbacks=[HFCallback()])``.

Outside a Pipette trial (no ``PIPETTE_TRIAL`` in the environment) every call is a cheap
no-op and ``step`` never asks to stop, so the same script runs unchanged from the launch
commands Pipette prints. Inside a trial each rank writes one JSON line per step on stdout,
prefixed with ``EVENT_PREFIX`` (the same events Pipette's own runner writes: ``step``, then
``done``), and ``step`` returns True once the trial has its warm-up and timed steps: every
rank counts the same steps, so all stop at the same one and no collective is left waiting.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

from pipette.contract import EVENT_PREFIX, event_line  # noqa: F401  (EVENT_PREFIX: part of this API)

#: The environment variable a script trial's ranks get: the trial's step counts and batch.
TRIAL_ENV = "PIPETTE_TRIAL"
#: Set once a ``Reporter`` reported a step in this process: a script that reports is timed by
#: its reports, and ends by itself (``workers/rank/script_hook`` then only watches).
REPORTING = False


class Reporter:
    """Times a script's optimizer steps and reports them to the Pipette trial it runs in.

    A step's time is the wall time from the previous ``step`` call (or from ``begin``) to
    this one: what the loop really spends per step, data loading included."""

    def __init__(
        self,
        environ: Mapping[str, str] | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        env = os.environ if environ is None else environ
        raw = env.get(TRIAL_ENV)
        self.trial: dict[str, Any] = json.loads(raw) if raw else {}
        self.active = bool(self.trial)
        self.rank = int(env.get("RANK", "0"))
        self.stream = stream
        self.clock = clock
        self.warmup_steps = int(self.trial.get("warmup_steps", 0))
        self.timed_steps = int(self.trial.get("timed_steps", 0))
        self.steps = 0
        self.times: list[float] = []
        self.losses: list[float] = []
        self.last = clock()
        self.finished = False
        self.log: dict[str, float] = {}

    def begin(self) -> None:
        """Start the clock of the next step here (call before the loop's first batch)."""
        self.last = self.clock()

    def step(
        self,
        loss: float | None = None,
        samples: int | None = None,
        step_time: float | None = None,
        peak_memory_bytes: int | None = None,
        micro_batch: int | None = None,
    ) -> bool:
        """Report one optimizer step; returns True when the script should stop.

        ``samples``: sequences this step trained over all ranks (the global batch); Pipette
        checks it against the candidate's, and ``micro_batch`` (sequences a rank runs through
        forward and backward at once) against the candidate's micro-batch. ``step_time``:
        seconds, when the script times its steps itself (else the wall time since the last call)."""
        now = self.clock()
        elapsed = float(step_time) if step_time is not None else now - self.last
        self.last = now
        if not self.active:
            return False
        global REPORTING
        REPORTING = True
        warm = self.steps < self.warmup_steps
        if not warm:
            self.times.append(elapsed)
        if loss is not None:
            self.losses.append(float(loss))
        event: dict[str, Any] = {"event": "step", "rank": self.rank, "step": self.steps, "time": elapsed,
                                 "loss": None if loss is None else float(loss), "warmup": warm, "source": "reporter"}
        if samples is not None:
            event["samples"] = int(samples)
        if micro_batch is not None:
            event["micro_batch"] = int(micro_batch)
        if peak_memory_bytes is not None:
            event["peak_memory_bytes"] = int(peak_memory_bytes)
        self._emit(event)
        self.steps += 1
        return self.should_stop()

    def loss(self, value: float) -> None:
        """Record a loss logged after its step was reported (the HF Trainer logs it later)."""
        if self.active:
            self.losses.append(float(value))

    def should_stop(self) -> bool:
        """True once the trial has all its steps (never outside a trial)."""
        return self.active and self.steps >= self.warmup_steps + self.timed_steps

    def done(self, peak_memory_bytes: int | None = None) -> None:
        """Report the end of this rank's run (once; later calls do nothing)."""
        if not self.active or self.finished:
            return
        self.finished = True
        event: dict[str, Any] = {
            "event": "done", "rank": self.rank, "step_times": self.times, "losses": self.losses,
            "steps": self.steps, "peak_rss_bytes": _peak_rss_bytes(), "source": "reporter", "log": self.log,
        }
        peak = peak_memory_bytes if peak_memory_bytes is not None else _peak_device_bytes()
        if peak is not None:
            event["peak_memory_bytes"] = int(peak)
        self._emit(event)

    def _emit(self, event: dict[str, Any]) -> None:
        stream = self.stream or sys.stdout
        stream.write(event_line(event))
        stream.flush()


def _peak_rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _peak_device_bytes() -> int | None:
    """The CUDA allocator's peak, when the script uses a GPU (torch is not imported here)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.max_memory_allocated())
    except RuntimeError:
        return None
    return None


class HFCallback:
    """A Hugging Face ``TrainerCallback`` that reports every optimizer step to Pipette and
    stops the Trainer once the trial has its steps (``control.should_training_stop``).

    Written without importing ``transformers`` (so ``pipette`` stays dependency-free): the
    Trainer calls its callbacks' ``on_*`` methods by name, and the events this does not use
    are no-ops. The Trainer's own figures (``train_samples_per_second``, ...) are kept and
    sent with ``done``, so a trial shows both."""

    def __init__(self, reporter: Reporter | None = None) -> None:
        self.reporter = reporter or Reporter()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.reporter.begin()
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        # The step's loss is logged after this call (on_log): it goes to the losses, not the step.
        samples = None
        batch = getattr(args, "per_device_train_batch_size", None)
        accum = getattr(args, "gradient_accumulation_steps", None)
        world = getattr(args, "world_size", None)
        if batch and accum and world:
            samples = int(batch) * int(accum) * int(world)
        if self.reporter.step(samples=samples, micro_batch=int(batch) if batch else None):
            control.should_training_stop = True
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> Any:
        for key, value in (logs or {}).items():
            if isinstance(value, (int, float)) and key.startswith("train_"):
                self.reporter.log[key] = float(value)
        if logs and isinstance(logs.get("loss"), (int, float)):
            self.reporter.loss(float(logs["loss"]))
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.reporter.done()
        return control

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):
            return lambda args, state, control, **kwargs: control
        raise AttributeError(name)
