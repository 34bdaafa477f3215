"""How a trial's rank processes are started, read and ended, whatever they run.

A ``Transport`` starts one fresh process per rank and hands back what each wrote
(``workers.host.rank_output``) and its exit; ``workers.host.monitor`` decides from that how the
run ended. Two implementations: ``RayTransport`` (``workers.host.ray_transport``: one Ray
actor per rank, placed on the rank's node) and ``LocalTransport`` (this machine, no Ray). The
rank's environment is built once, by ``pipette.contract.rank_env``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pipette.contract import rank_env
from workers.cpu_isa import cpu_isa_env
from workers.host.script_env import script_environment, script_path, with_hook

#: each rank's new event lines and its exit status (None while it runs)
Polled = list[tuple[list[str], int | None]]


@dataclass(frozen=True)
class Launch:
    """What every rank of one run starts with: ``files`` written to its own folder (named in
    ``argv`` as ``$PIPETTE_RANK_DIR``), ``argv``, ``env`` over the rank's own, the folder each
    rank runs in (None: its own), and ``clean_env`` for a user's script (no credentials), started
    as the OS user ``run_as`` where the service says (``workers.host.script_user``)."""

    files: dict[str, str]
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwds: tuple[str | None, ...] = ()
    clean_env: bool = False
    run_as: str | None = None

    def cwd(self, rank: int) -> str | None:
        return self.cwds[rank] if rank < len(self.cwds) else None


class Transport(Protocol):
    """The processes of one run, one per rank."""

    world: int
    device_kind: str
    #: seconds the monitor waits between two polls of the ranks
    poll_s: float

    def master(self) -> tuple[str, int]:
        """Where rank 0's rendezvous store listens (an address the other ranks reach)."""
        ...

    def gpus(self) -> list[str]:
        """The GPU each rank sees (``CUDA_VISIBLE_DEVICES``); empty on CPU devices."""
        ...

    def local_rank(self, rank: int) -> int:
        ...

    def ship(self, package: bytes) -> list[str]:
        """Unpack a job's working directory (``workers.host.workdir.pack``) where each rank runs."""
        ...

    def prepare(self, launch: Launch, should_stop: Callable[[], bool]) -> bool:
        """Get ready before the clock starts; False when ``should_stop`` said stop first."""
        ...

    def start(self, rank: int, launch: Launch, env: dict[str, str]) -> int:
        """Start ``rank`` with ``env`` over its base environment; its process id."""
        ...

    def poll(self) -> tuple[Polled, dict[int, str]]:
        """The new event lines and exits of every rank, and the ranks lost (with why)."""
        ...

    def unreachable(self) -> list[int]:
        """Ranks not answering now (their node down or cut off), not yet counted lost."""
        ...

    def output_tail(self, rank: int) -> str:
        ...

    def where(self, rank: int) -> str:
        """How a message names ``rank``: its node, address and device."""
        ...

    def hosts(self, ranks: list[int]) -> tuple[str, ...]:
        """The addresses of the nodes of ``ranks`` (a lost node's, for the runner's retry)."""
        ...

    def close(self) -> None:
        """End every rank and what it started; nothing is left running."""
        ...


def start_ranks(transport: Transport, launch: Launch, extra_env: dict[str, str]) -> tuple[int, ...]:
    """Start every rank of ``transport`` with its contract environment; their process ids."""
    master, gpus = transport.master(), transport.gpus()
    pids = []
    for rank in range(transport.world):
        env = rank_env(transport.device_kind, rank, transport.world, master, gpus[rank] if gpus else None,
                       transport.local_rank(rank))
        pids.append(transport.start(rank, launch, env | launch.env | extra_env))
    return tuple(pids)


def process_env(env: dict[str, str], clean_env: bool, rank_dir: str) -> dict[str, str]:
    """A rank process's whole environment: this process's (for a user's script only what a
    training process needs: ``workers.host.script_env``), the CPU's instruction limits, ``env``."""
    base = script_environment(os.environ) if clean_env else dict(os.environ)
    full = {**base, **cpu_isa_env(), **env, "PIPETTE_RANK_DIR": rank_dir}
    if clean_env:
        full["PATH"] = script_path(full.get("PATH", ""))
        full["PYTHONPATH"] = with_hook(base.get("PYTHONPATH"))
    return full


def rank_argv(argv: list[str], rank_dir: str) -> list[str]:
    return [a.replace("$PIPETTE_RANK_DIR", rank_dir) for a in argv]
