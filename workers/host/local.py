"""Run a trial on this machine without Ray: one fresh process per rank, the ranks' GPUs (or
CPU devices) on this node as the placement names them.

This is what the GPU suite (``tests/gpu``) and the GPU benchmarks run on a machine that has a
GPU but no Ray, and what a user can run to time one candidate by hand. It is the product's
trial path with another transport: the same kinds of trial (``workers.host.kinds``) and the
same monitor (``workers.host.monitor``) as the Ray executor (``workers.host.executor``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipette.measurement import Measurement
from workers.host.kinds import trial_kind
from workers.host.local_transport import LocalTransport
from workers.host.monitor import OUTPUT_TAIL_CHARS, OnPhase, OnStep, run_ranks
from workers.spec import TrialSpec
from workers.support import check_inputs, check_runnable


def run_local(trial: TrialSpec, timeout_s: float = 600.0, env: dict[str, str] | None = None,
              workdir: str | Path | None = None, *, on_step: OnStep | None = None,
              should_stop: Callable[[], bool] | None = None, on_phase: OnPhase | None = None) -> Measurement:
    """Run ``trial`` here and return what it measured (``extra["output_tail"]`` holds the
    last lines rank 0 printed that were not events)."""
    check_runnable(trial)
    check_inputs(trial)
    transport = LocalTransport(list(trial.config.devices()), trial.device_kind, workdir)
    kind = trial_kind(trial)
    try:
        watched = run_ranks(transport, kind, timeout_s, extra_env=env, on_step=on_step, should_stop=should_stop,
                            on_phase=on_phase)
        m = kind.measurement(watched)
        m.extra["output_tail"] = (watched.exit_tail or transport.output_tail(0))[-OUTPUT_TAIL_CHARS:]
        return m
    finally:
        transport.close()
