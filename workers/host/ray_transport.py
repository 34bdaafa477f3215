"""The ranks of a run as Ray actors (``workers.host.rank_process.RankProcess``), one per rank,
each pinned by a placement-group bundle to its node (``node:<address>``, one ``GPU`` on GPU
nodes, so Ray owns the run's GPUs); rank 0's store listens on its node."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pipette.errors import PipetteError
from workers.host.rank_process import RankProcess
from workers.host.ray_cluster import assign_gpus, rank_bundle, store_host
from workers.host.transport import Launch, Polled

#: a rank whose actor does not answer for this long is lost (its node is down or cut off)
LOST_AFTER_S = 10.0
#: how long Ray may take to place a run's ranks
PLACE_TIMEOUT_S = 60
#: seconds between two polls of the ranks' actors: each poll is a call to every actor (through
#: the Ray Client server too, for the service), so polling every 0.1 s kept those busy through
#: every trial; a step is timed by its rank, so reading it later changes no measurement
POLL_S = 0.5


class NotPlaced(PipetteError):
    """Ray could not place the ranks within ``PLACE_TIMEOUT_S``."""


class RayTransport:
    """``slots``: (node index, local device index) of each rank; ``hosts``: the Ray address of
    each node index."""

    poll_s = POLL_S

    def __init__(self, slots: list[tuple[int, int]], hosts: list[str], device_kind: str,
                 zygote: bool = True) -> None:
        self.world, self.device_kind = len(slots), device_kind
        self.slots, self.node_hosts = slots, [hosts[n] for n, _ in slots]
        gpu = device_kind == "gpu"
        self.pg: PlacementGroup = placement_group([rank_bundle(h, gpu) for h in self.node_hosts], strategy="PACK")
        if not self.pg.wait(timeout_seconds=PLACE_TIMEOUT_S):
            remove_placement_group(self.pg)
            raise NotPlaced(f"Ray could not place {self.world} ranks", field="cluster",
                            fix="free the devices (another job holds them?) or add Ray nodes")
        self.actors = [
            RankProcess.options(  # type: ignore[attr-defined]
                num_gpus=1 if gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
            ).remote()
            for rank in range(self.world)
        ]
        self.zygote = zygote
        self._gpus: list[str] | None = None
        self._master: tuple[str, int] | None = None
        self._unavailable: dict[int, float] = {}

    def master(self) -> tuple[str, int]:
        if self._master is None:
            host, port = ray.get(self.actors[0].address.remote(), timeout=60)
            self._master = (store_host(host, self.node_hosts), int(port))
        return self._master

    def gpus(self) -> list[str]:
        if self.device_kind != "gpu":
            return []
        if self._gpus is None:
            held = ray.get([a.gpu_ids.remote() for a in self.actors], timeout=60)
            self._gpus, _ = assign_gpus([n for n, _ in self.slots], [d for _, d in self.slots], held)
        return self._gpus

    def local_rank(self, rank: int) -> int:
        return self.slots[rank][1]

    def ship(self, package: bytes) -> list[str]:
        ref = ray.put(package)
        return list(ray.get([a.unpack.remote(ref) for a in self.actors], timeout=120))

    def prepare(self, launch: Launch, should_stop: Callable[[], bool]) -> bool:
        """Have each node's zygote up (a CPU rank's warm start) before the clock starts."""
        env = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""} if self.device_kind == "cpu" else {}
        if not self.zygote:
            env["PIPETTE_ZYGOTE"] = "0"
        return _finished([a.prepare.remote(launch.argv, env | launch.env) for a in self.actors], 400, should_stop)

    def start(self, rank: int, launch: Launch, env: dict[str, str]) -> int:
        if not self.zygote:
            env = env | {"PIPETTE_ZYGOTE": "0"}
        ref = self.actors[rank].start.remote(launch.files, launch.argv, env, launch.cwd(rank), launch.clean_env,
                                             launch.run_as)
        return int(ray.get(ref, timeout=60))

    def poll(self) -> tuple[Polled, dict[int, str]]:
        """A dead actor (its node gone: ``max_restarts=0``) is lost at once; one that does not
        answer (``ActorUnavailableError``, a timed-out poll) once that lasts ``LOST_AFTER_S``,
        so a network blip does not fail the run."""
        refs = [a.poll.remote() for a in self.actors]
        wait_s = LOST_AFTER_S
        try:  # every actor at once: one round trip where all answer (the common case)
            polled: Polled = list(ray.get(refs, timeout=LOST_AFTER_S))
            self._unavailable.clear()
            return polled, {}
        except ray.exceptions.GetTimeoutError:
            wait_s = 0.0  # the others answered within that wait: read them, not wait again
        except ray.exceptions.RayError:
            pass  # one of them died: each on its own below
        polled = []
        lost: dict[int, str] = {}
        for rank, ref in enumerate(refs):
            try:
                polled.append(ray.get(ref, timeout=wait_s))
                self._unavailable.pop(rank, None)
                continue
            except ray.exceptions.ActorDiedError as e:
                self._unavailable.setdefault(rank, time.monotonic())
                lost[rank] = f"its Ray actor died (node down?): {e}"
            except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError) as e:
                since = self._unavailable.setdefault(rank, time.monotonic())
                if time.monotonic() - since >= LOST_AFTER_S:
                    lost[rank] = f"unreachable for {time.monotonic() - since:.0f} s: {type(e).__name__}: {e}"
            polled.append(([], None))
        return polled, lost

    def unreachable(self) -> list[int]:
        return sorted(self._unavailable)

    def output_tail(self, rank: int) -> str:
        try:
            return str(ray.get(self.actors[rank].output_tail.remote(), timeout=30))
        except ray.exceptions.RayError as e:
            return f"(its output could not be read: {type(e).__name__})"

    def where(self, rank: int) -> str:
        gpu = f", GPU {self._gpus[rank]}" if self._gpus else ""
        return f"rank {rank} (node {self.slots[rank][0]}, {self.node_hosts[rank]}{gpu})"

    def hosts(self, ranks: list[int]) -> tuple[str, ...]:
        return tuple(sorted({self.node_hosts[r] for r in ranks}))

    def close(self) -> None:
        for a in self.actors:
            try:
                ray.get(a.kill.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError):
                pass  # the actor is gone already; its subprocess died with it (PDEATHSIG)
            ray.kill(a)
        remove_placement_group(self.pg)


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
