"""The tuner's ``TrialRunner`` on Ray: a candidate in, a ``Measurement`` out.

Bridges ``pipette.tuner`` (pure: it only knows the ``TrialRunner`` protocol) and the Ray
executor: builds the ``TrialSpec`` of a candidate (memory cap = the device's usable memory
on CPU, so an over-large candidate ends as ``oom`` rather than swapping the machine),
relays every measured step to the tuner (which may prune), and says which candidates the
backends cannot run so the tuner never proposes them.

Lost nodes: before every trial the runner checks that Ray has a live node for each node of the
cluster. When one is missing (a host died, possibly in the previous trial, which then ended
``failed`` naming it) it waits for it to come back, telling ``on_wait`` every few seconds, up to
``node_wait_s``; then it raises, and the job fails with every trial kept. A node a trial lost
counts as missing until Ray replaces it (a new node id at its address) or ``suspect_s`` passes,
so the rerun does not start on a node Ray has not yet noticed is dead.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pipette.cluster import ClusterProfile
from pipette.config import ParallelConfig
from pipette.errors import PipetteError
from pipette.measurement import Measurement
from pipette.model import ModelSpec
from pipette.script import ScriptSpec
from pipette.training import TrainingSpec
from pipette.tuner import OnStep, StepProgress
from workers.spec import TrialSpec
from workers.support import refusals_for


@dataclass
class RayTrialRunner:
    model: ModelSpec
    training: TrainingSpec
    cluster: ClusterProfile
    device_kind: str = "cpu"
    timeout_s: float = 300.0
    warmup_steps: int = 2
    min_steps: int = 3
    max_steps: int = 10
    rel_ci: float = 0.05
    seed: int = 0
    data: str | None = None
    checkpoint: str | None = None
    #: the user's own training script, run instead of Pipette's runner (``pipette.script``)
    script: ScriptSpec | None = None
    #: the stack Pipette's runner trains with (``pipette.stacks.runner_stacks``) unless the candidate
    #: names its own (a plan over several stacks: ``ParallelConfig.stack``); unused for a script
    stack: str = "pipette"
    #: ship the script's working directory to the ranks' nodes with Ray's runtime environment
    #: (the service; a remote cluster) instead of running it in place (a local Ray)
    ship_workdir: bool = False
    #: extra environment for every rank (e.g. NCCL settings)
    env: dict[str, str] = field(default_factory=dict)
    #: how long to wait for lost nodes to come back before a trial (seconds)
    node_wait_s: float = 1800.0
    #: told what is missing while waiting (``None`` once they are back); returning True stops
    #: the wait and the trial ends ``pruned`` ("cancelled"), as a cancelled trial does
    on_wait: Callable[[list[str] | None], bool | None] | None = None
    #: asked while a trial runs, between its steps too (an op build, a hung import): True stops
    #: the trial within a poll interval and it ends ``pruned`` ("cancelled")
    should_stop: Callable[[], bool] | None = None
    #: how often the wait asks Ray for its nodes (seconds)
    node_poll_s: float = 2.0
    #: after a trial lost a node, its Ray node counts as dead this long even while Ray still
    #: lists it alive (Ray notices a killed node only after a while: in a shaped-cluster run a
    #: trial started after the loss still found it listed); a blip that outlives this is over
    suspect_s: float = 90.0
    #: told what the runner does outside the trials (DeepSpeed's op build: ``prepare``)
    on_note: Callable[[str], None] | None = None
    #: told the phase the running trial's ranks are in and its elapsed seconds (``workers.host.executor``)
    on_phase: Callable[[str, float], None] | None = None
    _suspects: dict[str, float] = field(default_factory=dict, repr=False)
    _prepared: bool = field(default=False, repr=False)

    def trial(self, config: ParallelConfig) -> TrialSpec:
        cap = self.cluster.min_usable_memory if self.device_kind == "cpu" else None
        peak = self.cluster.device_spec.peak_flops.get(self.training.dtype)
        return TrialSpec(
            self.model, self.training, config, warmup_steps=self.warmup_steps,
            min_steps=min(self.min_steps, self.max_steps), max_steps=self.max_steps, rel_ci=self.rel_ci,
            memory_cap_bytes=cap, device_kind=self.device_kind, peak_flops=peak, seed=self.seed, data=self.data,
            checkpoint=self.checkpoint, script=self.script, stack=config.stack or self.stack,
        )

    def refusals(self, config: ParallelConfig) -> list[str]:
        """Why the backends (or the user's script) cannot run ``config`` (empty when they can);
        starts nothing."""
        nodes = [d.node for d in self.cluster.devices]
        return refusals_for(self.model, self.training, config, self.device_kind, self.script, nodes,
                            config.stack or self.stack)

    def prepare(self, force: bool = False, config: ParallelConfig | None = None) -> bool:
        """Build DeepSpeed's CPU op on every node once, before the first trial that runs DeepSpeed
        (``needs_deepspeed_op``), outside any trial's timeout: built inside one, it timed out trial
        after trial on a fresh environment, charged to the candidates. False when ``should_stop``
        stopped the build (it is built again next time)."""
        if (self._prepared and not force) or not self.needs_deepspeed_op(config):
            return True
        from workers.host.node_ops import build_on_nodes
        from workers.host.ray_cluster import ensure_ray, ray_node_ips

        ensure_ray()
        if build_on_nodes(ray_node_ips(self.cluster), self.env, self.on_note or _log, force=force,
                          should_stop=self.should_stop) is None:
            return False
        self._prepared = True
        return True

    def needs_deepspeed_op(self, config: ParallelConfig | None = None) -> bool:
        """Whether a trial of ``config`` (None: of the job's own stack) runs DeepSpeed on CPU
        devices: a DeepSpeed script, or Pipette's DeepSpeed runner. An FSDP script and the
        PyTorch-native runner never load it (an FSDP-only job built it for 147 s first: issue
        43, item 28)."""
        from workers.host.kinds import runs_deepspeed

        stack = (config.stack if config is not None else None) or self.stack
        return self.device_kind == "cpu" and runs_deepspeed(self.script, stack)

    def __call__(self, config: ParallelConfig, on_step: OnStep) -> Measurement:
        from workers.host.executor import StepReport, run_trial

        spec = self.trial(config)
        if not self.wait_for_nodes():
            return Measurement("pruned", tokens_per_step=spec.tokens_per_step,
                               error="cancelled while waiting for lost nodes")
        if not self.prepare(config=config):
            return _stopped_building(spec)

        def relay(report: StepReport) -> bool:
            return bool(on_step(StepProgress(report.step, report.time, report.warmup, report.loss)))

        m = run_trial(spec, self.cluster, timeout_s=self.timeout_s, on_step=relay, env=self.env,
                      ship_workdir=self.ship_workdir, should_stop=self.should_stop,
                      on_phase=self.on_phase)
        if m.status in ("failed", "timeout") and m.details.stopped_in == "ops" and self.device_kind == "cpu":
            # Caught building the op after all (the environment changed under the job): the
            # environment's failure, not the candidate's. Build it outside the trial, run again.
            if not self.prepare(force=True, config=config):
                return _stopped_building(spec)
            m = run_trial(spec, self.cluster, timeout_s=self.timeout_s, on_step=relay, env=self.env,
                          ship_workdir=self.ship_workdir, should_stop=self.should_stop, on_phase=self.on_phase)
            if m.status in ("failed", "timeout") and m.details.stopped_in == "ops":
                from workers.ops import WHAT, OpsBuildError

                raise OpsBuildError(f"the trial's ranks were stuck in {WHAT} twice, once after building it: "
                                    f"{m.error}", field="environment",
                                    fix="run python -m workers.ops on the node and look at its output")
        lost = set(m.lost_nodes)
        if m.status == "failed" and lost:
            from workers.host.ray_cluster import alive_nodes

            now = time.monotonic()
            self._suspects |= {n["NodeID"]: now for n in alive_nodes() if n["NodeManagerAddress"] in lost}
        return m

    def wait_for_nodes(self) -> bool:
        """Return once every node of the cluster has a live Ray node (True), or when ``on_wait``
        says stop (False); raise after ``node_wait_s``."""
        from workers.host.ray_cluster import ensure_ray, missing_nodes

        ensure_ray()
        started = time.monotonic()

        def missing_now() -> list[str]:
            now = time.monotonic()
            self._suspects = {k: t for k, t in self._suspects.items() if now - t < self.suspect_s}
            return missing_nodes(self.cluster, frozenset(self._suspects))

        missing = missing_now()
        if not missing:
            return True
        while missing:
            waited = time.monotonic() - started
            if self.on_wait is not None and self.on_wait(missing):
                return False
            if waited > self.node_wait_s:
                raise PipetteError(
                    f"Ray has had no live node for {', '.join(missing)} for {waited:.0f} s",
                    field="cluster.nodes",
                    fix="restart Ray on the lost hosts (ray start --address=HEAD:PORT), then run the job again: "
                        "the trials measured so far are kept and inform it",
                )
            time.sleep(self.node_poll_s)
            missing = missing_now()
        if self.on_wait is not None:
            self.on_wait(None)
        return True


def _stopped_building(spec: TrialSpec) -> Measurement:
    """The trial that was waiting for the op build, when the job was told to stop during it."""
    from workers.ops import WHAT

    return Measurement("pruned", tokens_per_step=spec.tokens_per_step, error=f"cancelled while building {WHAT}")


def _log(line: str) -> None:
    logging.getLogger("pipette.ops").info("%s", line)
