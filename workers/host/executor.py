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

import time
from collections.abc import Callable

import ray

from pipette.cluster import ClusterProfile
from pipette.errors import PipetteError, SpecError
from pipette.measurement import Measurement
from workers.host.kinds import trial_kind
from workers.host.monitor import OUTPUT_TAIL_CHARS, OnPhase, OnStep, StepReport, run_ranks
from workers.host.ray_cluster import check_devices, ensure_ray, missing_nodes, node_gpus, ray_node_ips
from workers.host.ray_transport import PLACE_TIMEOUT_S, NotPlaced, RayTransport
from workers.spec import TrialSpec
from workers.support import check_inputs, check_runnable

__all__ = ["OnPhase", "OnStep", "StepReport", "run_trial"]


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
    if cluster is not None:
        check_devices(cluster, ips)
    elif trial.device_kind == "gpu" and node_gpus(ips[0]) < len(slots):
        raise PipetteError(f"a GPU trial of {len(slots)} ranks, but Ray has {node_gpus(ips[0])} GPU(s) here",
                           field="cluster", fix="run it where Ray has the GPUs (RAY_ADDRESS)")
    try:
        transport = RayTransport(slots, ips, trial.device_kind)
    except NotPlaced:
        lost = _missing(cluster)
        if lost:  # a node died since the trial was planned: the cluster's failure, not the candidate's
            return Measurement("failed", tokens_per_step=trial.tokens_per_step,
                               error=f"Ray could not place {len(slots)} ranks: lost {', '.join(lost)}",
                               extra={"wall_s": float(PLACE_TIMEOUT_S), "backend": None}, lost_nodes=tuple(lost))
        raise
    started = time.monotonic()
    kind = trial_kind(trial, ship_workdir)
    try:
        watched = run_ranks(transport, kind, timeout_s, extra_env=env, on_step=on_step, should_stop=should_stop,
                            on_phase=on_phase)
        m = kind.measurement(watched)
        if transport.gpus():
            m.extra["gpus"] = transport.gpus()
        if m.status in ("failed", "timeout", "oom"):
            # what the rank said last, kept in the record: a timed-out script kept nothing
            m.extra["output_tail"] = (watched.exit_tail or transport.output_tail(0))[-OUTPUT_TAIL_CHARS:]
        return m
    except ray.exceptions.RayError as e:
        refused = pipette_error(e)
        if refused is not None:  # the node refused on purpose (an unsafe runtime file): one line, the fix
            raise refused from None
        # A node lost while the ranks start (the monitor names the rank of one lost later).
        return Measurement("failed", tokens_per_step=trial.tokens_per_step,
                           error=f"Ray lost a rank's node: {type(e).__name__}: {e}",
                           extra={"wall_s": time.monotonic() - started, "backend": None},
                           lost_nodes=tuple(_missing(cluster)))
    finally:
        transport.close()


def pipette_error(error: BaseException) -> PipetteError | None:
    """The PipetteError a Ray task raised, through any tasks that awaited it (a rank's actor
    waits on its node's zygote host), else None. Ray wraps it in a ``RayTaskError`` whose text
    is the remote traceback; its ``cause`` is the error itself."""
    for _ in range(8):
        if not isinstance(error, ray.exceptions.RayTaskError):
            return error if isinstance(error, PipetteError) else None
        cause = error.cause
        if cause is None or cause is error:
            return None
        error = cause
    return None


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
