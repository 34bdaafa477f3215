"""The two kinds of trial, chosen once per trial (``trial_kind``): Pipette's own runner
(``workers.rank.train`` on the candidate) and a user's training script. Each launches its
ranks, reads their events for ``workers.host.monitor`` and turns how the run ended into a
``Measurement``; the monitor and the transports do not know which kind they run.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable
from typing import Any

from pipette.measurement import Measurement, last_error_line
from pipette.registry import runner_of
from pipette.script import ScriptSpec
from workers.host.monitor import Finished, Watched, exit_text
from workers.host.outcome import Outcome, measurement
from workers.host.script_trial import script_events, script_launch, script_measurement
from workers.host.transport import Launch, Transport
from workers.host.workdir import pack
from workers.phases import script_timeout_text, timeout_text
from workers.spec import TrialSpec

#: How a script's out-of-memory crash reads (torch's CUDA and CPU allocators, the kernel's kill)
SCRIPT_OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|DefaultCPUAllocator: can't allocate|MemoryError")
#: a script's rank that reported its end is given this long to exit; one still in its teardown
#: then is stopped and the trial kept (CI saw a test script, which skips
#: ``destroy_process_group``, abort there; pytorch/pytorch#190489 reports that abort for gloo)
EXIT_GRACE_S = 30.0


class RunnerTrial:
    """Pipette's runners (the trial's stack's ``Stack.runner``: DeepSpeed's, ``workers.rank.train``,
    or the PyTorch-native one, ``workers.rank.fsdp``): rank 0 reports every step, every rank its
    ``done``; a rank that ran out of memory says so (``oom``) and exits with ``OOM_EXIT``."""

    def __init__(self, trial: TrialSpec) -> None:
        self.trial, self.world = trial, trial.config.world
        self.steps: list[dict[str, Any]] = []
        self.done: dict[int, dict[str, Any]] = {}
        self.ooms: list[dict[str, Any]] = []

    def launch(self, transport: Transport) -> Launch:
        runner = runner_of(self.trial.stack)
        files = {"candidate.json": json.dumps(self.trial.candidate())}
        if runner.deepspeed:  # the PyTorch-native runner reads the candidate alone
            files["ds_config.json"] = json.dumps(self.trial.ds_config())
        return Launch(files, [sys.executable, *runner.rank_args()])

    def take(self, rank: int, event: dict[str, Any]) -> dict[str, Any] | None:
        kind = event.get("event")
        if kind == "step" and rank == 0:
            self.steps.append(event)
            return event
        if kind == "done":
            self.done[rank] = event
        elif kind == "oom":
            self.ooms.append(event)
        return None

    def failure(self) -> Outcome | None:
        return Outcome("oom") if self.ooms else None

    def ended(self, rank: int) -> bool:
        return False  # every exit counts: a rank's non-zero exit after its done fails the trial

    def finished(self, codes: dict[int, int]) -> Finished:
        whole = len(self.done) == self.world and len(codes) == self.world and not any(codes.values())
        return "yes" if whole else "no"

    def exit_failure(self, head: str, tail: str) -> Outcome | None:
        return None

    def all_exited(self) -> Outcome:
        return Outcome("failed", f"{self.world - len(self.done)} rank(s) exited without reporting their steps")

    def timed_out(self, timeout_s: float, behind: str | None, last_step: int | None,
                  tail: Callable[[], str]) -> Outcome:
        return Outcome("timeout", timeout_text(timeout_s, behind, last_step), phase=behind)

    def measurement(self, watched: Watched) -> Measurement:
        return measurement(self.trial, watched.outcome, self.steps, self.done, self.ooms, watched.wall)


class ScriptTrial:
    """A user's script: timed by what it reports (``pipette.report``) or by its DeepSpeed
    engine (``workers/rank/script_hook``); a rank that reported its end may exit as it likes.
    ``ship``: its working directory travels to its ranks (a remote cluster) instead of being
    used where it is (a local Ray)."""

    def __init__(self, trial: TrialSpec, ship: bool = False) -> None:
        if trial.script is None:
            raise ValueError("not a script trial")
        self.trial, self.world, self.ship = trial, trial.config.world, ship
        self.events = script_events(trial)
        self.all_done_at: float | None = None
        self.exit_notes: dict[int, str] = {}

    def launch(self, transport: Transport) -> Launch:
        files, argv, env = script_launch(self.trial)
        workdir = self.trial.script.workdir if self.trial.script else None
        cwds: tuple[str | None, ...] = (workdir,) * self.world
        if self.ship and workdir is not None:
            cwds = tuple(transport.ship(pack(workdir)))
        return Launch(files, argv, env, cwds, clean_env=True, run_as=self.trial.script.run_as if self.trial.script
                      else None)

    def take(self, rank: int, event: dict[str, Any]) -> dict[str, Any] | None:
        return self.events.add(rank, event)

    def failure(self) -> Outcome | None:
        ignored = self.events.ignored_config()
        return Outcome("failed", ignored) if ignored else None

    def ended(self, rank: int) -> bool:
        return self.events.rank_done(rank)

    def finished(self, codes: dict[int, int]) -> Finished:
        """Every rank reported its end: the measurement is whole, though a rank died at exit or
        still lingers in it (stopped when the transport closes)."""
        if not self.events.all_done():
            return "no"
        self.all_done_at = self.all_done_at or time.monotonic()
        if len(codes) < self.world and time.monotonic() - self.all_done_at < EXIT_GRACE_S:
            return "wait"
        self.exit_notes = {r: exit_text(c) for r, c in codes.items() if c}
        self.exit_notes |= {r: f"had not exited {EXIT_GRACE_S:g} s after its end: stopped"
                            for r in range(self.world) if r not in codes}
        return "yes"

    def exit_failure(self, head: str, tail: str) -> Outcome | None:
        return Outcome("oom", f"{head}: {last_error_line(tail)}") if SCRIPT_OOM.search(tail) else None

    def all_exited(self) -> Outcome:
        return Outcome("ok")  # the measurement says what the script failed to report

    def timed_out(self, timeout_s: float, behind: str | None, last_step: int | None,
                  tail: Callable[[], str]) -> Outcome:
        if last_step is None:
            return Outcome("timeout", script_timeout_text(timeout_s, last_error_line(tail())))
        return Outcome("timeout", timeout_text(timeout_s, behind, last_step), phase=behind)

    def measurement(self, watched: Watched) -> Measurement:
        m = script_measurement(self.trial, watched.outcome, self.events, watched.wall, watched.exit_tail)
        if self.exit_notes:
            m.extra["exit_after_done"] = {str(r): text for r, text in self.exit_notes.items()}
        return m


TrialKind = RunnerTrial | ScriptTrial


def runs_deepspeed(script: ScriptSpec | None, stack: str) -> bool:
    """Whether a trial loads DeepSpeed: a DeepSpeed script, or a runner under DeepSpeed's engines
    (``Runner.deepspeed``: the ``pipette`` stack's); an FSDP script and the PyTorch-native runner never do."""
    if script is not None:
        return not script.fsdp
    return runner_of(stack).deepspeed


def trial_kind(trial: TrialSpec, ship_workdir: bool = False) -> TrialKind:
    """The kind of ``trial``: its script's when it has one, else Pipette's runner."""
    return ScriptTrial(trial, ship_workdir) if trial.script is not None else RunnerTrial(trial)
