"""Run a trial on Ray: one rank per device, each a fresh subprocess, placed as the candidate's
placement says, streamed back step by step, and always ended: ``ok``, ``oom``, ``failed``,
``timeout`` or ``pruned``, with nothing left running.

Placement: one placement-group bundle per rank, pinned to the Ray node of the rank's node
(``node:<address>`` resource), with one ``GPU`` on GPU nodes, so Ray owns the trial's GPUs;
the rank's device is its ``local_index`` on that node (``CUDA_VISIBLE_DEVICES`` on GPUs, among
the GPUs Ray gave the trial: ``ray_cluster.assign_gpus``). Ranks find each other through a
store on rank 0's node. A cluster whose devices are not the Ray nodes' (GPUs in the file, none
in Ray, or the reverse) is refused before anything starts.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pipette.cluster import ClusterProfile
from pipette.emit import RANK_ENV
from pipette.errors import PipetteError, SpecError
from pipette.measurement import Measurement, last_error_line
from workers.host.outcome import Outcome, measurement
from workers.host.rank_process import RankProcess
from workers.host.ray_cluster import (
    assign_gpus,
    check_devices,
    ensure_ray,
    missing_nodes,
    node_gpus,
    rank_bundle,
    ray_node_ips,
    store_host,
)
from workers.host.script_trial import ScriptEvents, script_launch, script_measurement
from workers.host.workdir import pack
from workers.phases import WORDS, earliest, script_timeout_text, timeout_text
from workers.spec import TrialSpec
from workers.support import check_inputs, check_runnable

OOM_EXIT = 3  # workers.rank.trial.OOM_EXIT
#: How a script's out-of-memory crash reads (torch's CUDA and CPU allocators, the kernel's kill)
SCRIPT_OOM = re.compile(r"OutOfMemoryError|CUDA out of memory|DefaultCPUAllocator: can't allocate|MemoryError")
POLL_S = 0.1
#: a rank whose actor does not answer for this long is lost (its node is down or cut off)
LOST_AFTER_S = 10.0
#: how long Ray may take to place a trial's ranks
PLACE_TIMEOUT_S = 60
#: a script's rank that reported its end is given this long to exit; one still in its teardown
#: then is stopped and the trial kept (CI saw a test script, which skips
#: ``destroy_process_group``, abort there; pytorch/pytorch#190489 reports that abort for gloo)
EXIT_GRACE_S = 30.0
#: how a trial stopped by ``should_stop`` reads (the tuner and the service look for "cancel")
CANCELLED = "cancelled"


@dataclass(frozen=True)
class StepReport:
    """One step of rank 0, as it happens."""

    step: int
    time: float
    loss: float
    warmup: bool
    #: seconds since the trial's processes started
    elapsed: float
    #: process id of each rank, on its node
    pids: tuple[int, ...]


#: Called after every step; returning True prunes the trial (stopped within a poll interval).
OnStep = Callable[[StepReport], bool | None]
#: Called with the phase the trial's ranks are in (the one furthest behind: ``workers.phases``)
#: and the seconds since they started, when it changes and about once a second.
OnPhase = Callable[[str, float], None]
#: how often ``OnPhase`` hears the elapsed time while the phase stays
PHASE_TICK_S = 1.0


def run_trial(
    trial: TrialSpec,
    cluster: ClusterProfile | None = None,
    *,
    timeout_s: float = 300.0,
    on_step: OnStep | None = None,
    env: dict[str, str] | None = None,
    ship_workdir: bool = False,
    should_stop: Callable[[], bool] | None = None,
    on_phase: OnPhase | None = None,
) -> Measurement:
    """Run ``trial`` and return what it measured. Refuses (raises) before starting anything
    when the backends cannot run the candidate or the placement does not fit the cluster.

    A script trial (``trial.script``) runs the user's script in its ``workdir``: shipped to the
    ranks' nodes with Ray's runtime environment when ``ship_workdir`` (the service, a remote
    cluster), used in place otherwise (a local Ray)."""
    check_runnable(trial)
    check_inputs(trial)
    slots = _slots(trial, cluster)
    ensure_ray()
    ips = ray_node_ips(cluster) if cluster is not None else [ray.util.get_node_ip_address()]
    gpu = trial.device_kind == "gpu"
    if cluster is not None:
        check_devices(cluster, ips)
    elif gpu and node_gpus(ips[0]) < len(slots):
        raise PipetteError(f"a GPU trial of {len(slots)} ranks, but Ray has {node_gpus(ips[0])} GPU(s) here",
                           field="cluster", fix="run it where Ray has the GPUs (RAY_ADDRESS)")
    pg = placement_group([rank_bundle(ips[node], gpu) for node, _ in slots], strategy="PACK")
    if not pg.wait(timeout_seconds=PLACE_TIMEOUT_S):
        remove_placement_group(pg)
        lost = _missing(cluster)
        if lost:  # a node died since the trial was planned: the cluster's failure, not the candidate's
            return Measurement("failed", tokens_per_step=trial.tokens_per_step,
                               error=f"Ray could not place {len(slots)} ranks: lost {', '.join(lost)}",
                               extra={"wall_s": float(PLACE_TIMEOUT_S), "backend": None, "lost_nodes": lost})
        raise PipetteError(
            f"Ray could not place {len(slots)} ranks", field="cluster", fix="free the devices or add Ray nodes"
        )
    # A script's working directory travels to its ranks' nodes through Ray's object store (each
    # rank runs in its unpacked copy: workers.host.workdir); a local one is used where it is.
    shipped = trial.script is not None and trial.script.workdir is not None and ship_workdir
    package = pack(trial.script.workdir) if shipped and trial.script and trial.script.workdir else None
    actors = [
        RankProcess.options(  # type: ignore[attr-defined]
            num_gpus=1 if gpu else 0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank),
        ).remote()
        for rank in range(len(slots))
    ]
    started = time.monotonic()
    try:
        return _run(trial, slots, [ips[node] for node, _ in slots], actors, timeout_s, on_step, env or {},
                    None if shipped else trial.script.workdir if trial.script else None, package,
                    should_stop or (lambda: False), on_phase)
    except ray.exceptions.RayError as e:
        # A node lost while the ranks start (``_poll`` names the rank of one lost later).
        return Measurement("failed", tokens_per_step=trial.tokens_per_step,
                           error=f"Ray lost a rank's node: {type(e).__name__}: {e}",
                           extra={"wall_s": time.monotonic() - started, "backend": None,
                                  "lost_nodes": _missing(cluster)})
    finally:
        for a in actors:
            try:
                ray.get(a.kill.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError):
                pass  # the actor is gone already; its subprocess died with it (PDEATHSIG)
            ray.kill(a)
        remove_placement_group(pg)


def _missing(cluster: ClusterProfile | None) -> list[str]:
    try:
        return missing_nodes(cluster) if cluster is not None else []
    except ray.exceptions.RayError:
        return []


def _slots(trial: TrialSpec, cluster: ClusterProfile | None) -> list[tuple[int, int]]:
    """(node, local device index) of each rank."""
    devices = trial.config.devices()
    if cluster is None:
        return [(0, d) for d in devices]
    bad = [d for d in devices if d >= cluster.world]
    if bad:
        raise SpecError(
            f"placement names device(s) {bad}, the cluster has {cluster.world}",
            field="config.placement", fix=f"use device indices 0..{cluster.world - 1}",
        )
    return [(cluster.devices[d].node, cluster.devices[d].local_index) for d in devices]


def _run(
    trial: TrialSpec,
    slots: list[tuple[int, int]],
    hosts: list[str],
    actors: list[Any],
    timeout_s: float,
    on_step: OnStep | None,
    extra_env: dict[str, str],
    workdir: str | None,
    package: bytes | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    on_phase: OnPhase | None = None,
) -> Measurement:
    world = len(slots)
    host, port = ray.get(actors[0].address.remote(), timeout=60)
    host = store_host(host, hosts)
    script = trial.script is not None
    events = ScriptEvents(world, trial.training.global_batch, zero_stage=trial.config.zero_stage)
    if trial.script is not None:
        files, argv, script_env = script_launch(trial)
        extra_env = script_env | extra_env
        if package is not None:
            ref = ray.put(package)
            cwds = ray.get([a.unpack.remote(ref) for a in actors], timeout=120)
        else:
            cwds = [workdir] * world
    else:
        files = {"candidate.json": json.dumps(trial.candidate()), "ds_config.json": json.dumps(trial.ds_config())}
        argv = [sys.executable, "-m", "workers.rank.train",
                "--deepspeed_config", "ds_config.json", "--candidate", "candidate.json"]
        cwds = [None] * world
    cpu_env = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""} if trial.device_kind == "cpu" else {}
    if not _finished([a.prepare.remote(argv, cpu_env | extra_env) for a in actors], 400, should_stop):
        return Measurement("pruned", tokens_per_step=trial.tokens_per_step,
                           error=f"{CANCELLED} before its ranks started", extra={"wall_s": 0.0, "backend": None})
    gpus: list[str] = []
    if trial.device_kind == "gpu":
        held = ray.get([a.gpu_ids.remote() for a in actors], timeout=60)
        gpus, _ = assign_gpus([n for n, _ in slots], [d for _, d in slots], held)
    start = time.monotonic()
    pids = []
    for rank, (_, local) in enumerate(slots):
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
               "MASTER_ADDR": host, "MASTER_PORT": str(port)} | RANK_ENV
        if trial.device_kind == "cpu":
            env |= {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
        else:  # the rank sees only its GPU, which Ray holds for this trial
            env |= {"CUDA_VISIBLE_DEVICES": gpus[rank], "LOCAL_RANK": "0"}
        env["PIPETTE_SPAWNED_AT"] = repr(time.time())
        pids.append(ray.get(actors[rank].start.remote(files, argv, env | extra_env, cwds[rank], script), timeout=60))

    def where(rank: int) -> str:
        gpu = f", GPU {gpus[rank]}" if gpus else ""
        return f"rank {rank} (node {slots[rank][0]}, {hosts[rank]}{gpu})"

    def ended(rank: int) -> bool:
        """A script's rank that reported its end: its exit, even by a signal, fails nothing."""
        return script and events.rank_done(rank)

    steps: list[dict[str, Any]] = []
    phases = RankPhases(world, on_phase)
    done: dict[int, dict[str, Any]] = {}
    ooms: list[dict[str, Any]] = []
    codes: dict[int, int] = {}
    outcome: Outcome | None = None
    exit_notes: dict[int, str] = {}
    unavailable: dict[int, float] = {}
    all_done_at: float | None = None
    #: the output of the rank whose exit failed the trial (none where Pipette ended it: a script
    #: that ignores its config is not one that "stopped before its first step")
    exit_tail = ""
    while outcome is None:
        if should_stop():
            last = steps[-1]["step"] if steps else None
            took = time.monotonic() - start
            outcome = Outcome("pruned", f"{CANCELLED} {took:.0f} s in (last step of rank 0: {last})")
            break
        polled, lost = _poll(actors, unavailable)
        if lost:
            rank, why = min(lost.items())
            outcome = Outcome("failed", f"{where(rank)} was lost: {why}",
                               lost=tuple(sorted({hosts[r] for r in lost})))
            break
        for rank, (lines, code) in enumerate(polled):
            for line in lines:
                event = json.loads(line)
                kind = event.get("event")
                if kind == "phase":
                    phases.enter(rank, str(event["phase"]))
                    continue
                if script:
                    relay = events.add(rank, event)
                    if relay is not None:
                        steps.append(relay)
                        loss = relay.get("loss")
                        report = StepReport(
                            int(relay["step"]), float(relay["time"]), float("nan") if loss is None else float(loss),
                            bool(relay.get("warmup")), time.monotonic() - start, tuple(pids),
                        )
                        if on_step is not None and on_step(report) and outcome is None:
                            outcome = Outcome("pruned", f"pruned by the caller after step {report.step}")
                    continue
                if kind == "step" and rank == 0:
                    steps.append(event)
                    report = StepReport(
                        int(event["step"]), float(event["time"]), float(event["loss"]), bool(event["warmup"]),
                        time.monotonic() - start, tuple(pids),
                    )
                    if on_step is not None and on_step(report) and outcome is None:
                        outcome = Outcome("pruned", f"pruned by the caller after step {report.step}")
                elif kind == "done":
                    done[rank] = event
                elif kind == "oom":
                    ooms.append(event)
            if code is not None:
                codes[rank] = code
        if outcome is not None:
            break
        phases.tick(time.monotonic() - start)
        ignored = events.ignored_config() if script else None
        if ignored:
            outcome = Outcome("failed", ignored)
        elif ooms:
            outcome = Outcome("oom")
        elif script and events.all_done():
            # Every rank reported its end: the measurement is whole, though a rank died at exit
            # or still lingers in it (stopped by the ``finally`` of ``run_trial``).
            all_done_at = all_done_at or time.monotonic()
            if len(codes) < world and time.monotonic() - all_done_at < EXIT_GRACE_S:
                time.sleep(POLL_S)
                continue
            outcome = Outcome("ok")
            exit_notes = {r: _exit_text(c) for r, c in codes.items() if c}
            exit_notes |= {r: f"had not exited {EXIT_GRACE_S:g} s after its end: stopped"
                           for r in range(world) if r not in codes}
        elif any(c != 0 and not ended(r) for r, c in codes.items()):
            time.sleep(0.5)  # let the other ranks' last lines (an oom report) and exits arrive
            for rank, (lines, code) in enumerate(_poll(actors, unavailable)[0]):
                ooms += [e for e in map(json.loads, lines) if e.get("event") == "oom"]
                if code is not None:
                    codes[rank] = code
            if ooms:
                outcome = Outcome("oom")
            else:
                # the cause is a rank that failed before its end, not one that aborted after it
                rank, code = _root_cause({r: c for r, c in codes.items() if not ended(r)})
                tail = exit_tail = ray.get(actors[rank].output_tail.remote(), timeout=30)
                head = f"{where(rank)} {_exit_text(code)}{phases.during(rank)}"
                if script and SCRIPT_OOM.search(tail):
                    outcome = Outcome("oom", f"{head}: {last_error_line(tail)}")
                    break
                if unavailable:  # the cause: a lost node; the exit is its consequence
                    gone = ", ".join(where(r) for r in sorted(unavailable))
                    head = f"{gone} became unreachable (node down?); then {head}"
                outcome = Outcome("failed", f"{head}\n{tail[-4000:]}",
                                   lost=tuple(sorted({hosts[r] for r in unavailable})), phase=phases.of.get(rank))
        elif len(codes) == world and (script or len(done) == world):
            outcome = Outcome("ok")
        elif time.monotonic() - start > timeout_s:
            last = int(steps[-1]["step"]) if steps else None
            if script and last is None:
                said = last_error_line(ray.get(actors[0].output_tail.remote(), timeout=30))
                outcome = Outcome("timeout", script_timeout_text(timeout_s, said))
            else:
                outcome = Outcome("timeout", timeout_text(timeout_s, phases.behind(), last), phase=phases.behind())
        else:
            time.sleep(POLL_S)
    wall = time.monotonic() - start
    if script:
        m = script_measurement(trial, outcome, events, wall, exit_tail)
        if exit_notes:
            m.extra["exit_after_done"] = {str(r): text for r, text in exit_notes.items()}
    else:
        m = measurement(trial, outcome, steps, done, ooms, wall)
        if gpus:
            m.extra["gpus"] = gpus
    if m.status in ("failed", "timeout", "oom"):
        # what the rank said last, kept in the record: a timed-out script kept nothing
        m.extra["output_tail"] = (exit_tail or _output_tail(actors[0]))[-OUTPUT_TAIL_CHARS:]
    return m


#: the characters of a failed trial's output kept in its record
OUTPUT_TAIL_CHARS = 4000


def _output_tail(actor: Any) -> str:
    try:
        return str(ray.get(actor.output_tail.remote(), timeout=30))
    except ray.exceptions.RayError as e:
        return f"(its output could not be read: {type(e).__name__})"


def _finished(refs: list[Any], timeout_s: float, should_stop: Callable[[], bool]) -> bool:
    """Wait for ``refs`` (raising as ``ray.get`` does after ``timeout_s``), asking ``should_stop``
    every poll: False when it said stop first."""
    deadline = time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        if should_stop():
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            break
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(0.5, left))
    ray.get(refs, timeout=0.1)  # the ranks' errors, or Ray's timeout, as before
    return True


Polled = list[tuple[list[str], int | None]]


class RankPhases:
    """The phase each rank is in (its ``phase`` events), told to ``on_phase`` as it changes."""

    def __init__(self, world: int, on_phase: OnPhase | None) -> None:
        self.of: dict[int, str] = {}
        self.world, self.on_phase = world, on_phase
        self.told: tuple[str, float] | None = None

    def enter(self, rank: int, phase: str) -> None:
        self.of[rank] = phase

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



def _poll(actors: list[Any], unavailable: dict[int, float]) -> tuple[Polled, dict[int, str]]:
    """Each rank's new event lines and exit status, and the ranks lost with their Ray node.

    A dead actor (its node gone: ``max_restarts=0``) is lost at once; one that does not answer
    (``ActorUnavailableError``, a timed-out poll) is lost once that lasts ``LOST_AFTER_S``,
    so a network blip does not fail the trial. ``unavailable`` keeps when that began."""
    refs = [a.poll.remote() for a in actors]
    polled: list[tuple[list[str], int | None]] = []
    lost: dict[int, str] = {}
    for rank, ref in enumerate(refs):
        try:
            polled.append(ray.get(ref, timeout=LOST_AFTER_S))
            unavailable.pop(rank, None)
            continue
        except ray.exceptions.ActorDiedError as e:
            unavailable.setdefault(rank, time.monotonic())
            lost[rank] = f"its Ray actor died (node down?): {e}"
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError) as e:
            since = unavailable.setdefault(rank, time.monotonic())
            if time.monotonic() - since >= LOST_AFTER_S:
                lost[rank] = f"unreachable for {time.monotonic() - since:.0f} s: {type(e).__name__}: {e}"
        polled.append(([], None))
    return polled, lost


def _root_cause(codes: dict[int, int]) -> tuple[int, int]:
    """The rank whose exit explains the failure: one killed by a signal first (its peers then
    fail on the broken collective, often before its own exit is seen), else the lowest rank
    that exited non-zero."""
    failed = sorted((r, c) for r, c in codes.items() if c != 0)
    return next(((r, c) for r, c in failed if c < 0), failed[0])


def _exit_text(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"
