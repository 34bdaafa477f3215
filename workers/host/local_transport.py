"""The ranks of a run as plain processes on this machine, without Ray: what the GPU suite and
the GPU benchmarks run on a machine that has a GPU but no Ray, through the same monitor and
kinds of trial as the Ray path (``workers.host.monitor``)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from pipette.errors import PipetteError
from workers.host.rank_output import RankOutput
from workers.host.transport import Launch, Polled, process_env, rank_argv
from workers.ops import kill_session
from workers.ports import hold_port

ROOT = str(Path(__file__).resolve().parents[2])


class LocalTransport:
    """``devices``: the local device index of each rank (a GPU's index, or a CPU device's)."""

    #: a poll reads this process's pipes: cheap, so often
    poll_s = 0.1

    def __init__(self, devices: list[int], device_kind: str, workdir: str | Path | None = None) -> None:
        self.world, self.device_kind, self.devices = len(devices), device_kind, devices
        self.work = Path(workdir or tempfile.mkdtemp(prefix="pipette-local-"))
        self.procs: list[subprocess.Popen[str] | None] = [None] * self.world
        self.outputs = [RankOutput() for _ in devices]
        self._port = hold_port("127.0.0.1")  # until close(): workers.ports
        self.port = int(self._port.getsockname()[1])

    def master(self) -> tuple[str, int]:
        return "127.0.0.1", self.port

    def gpus(self) -> list[str]:
        return [str(d) for d in self.devices] if self.device_kind == "gpu" else []

    def local_rank(self, rank: int) -> int:
        return self.devices[rank]

    def ship(self, package: bytes) -> list[str]:
        from workers.host.workdir import unpack

        return [unpack(package, self.work / f"rank{r}" / "job") for r in range(self.world)]

    def prepare(self, launch: Launch, should_stop: Callable[[], bool]) -> bool:
        return not should_stop()

    def start(self, rank: int, launch: Launch, env: dict[str, str]) -> int:
        if launch.run_as is not None:  # only the service runs a tenant's script, on Ray (RankProcess)
            raise PipetteError(f"cannot start a script as user {launch.run_as!r} without Ray", field="script",
                               fix="run the job through the service on Ray")
        rank_dir = self.work / f"rank{rank}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        for name, text in launch.files.items():
            (rank_dir / name).write_text(text)
        full = process_env(env, launch.clean_env, str(rank_dir))
        if not launch.clean_env:  # this checkout's workers, wherever the rank runs
            full["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, full.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(rank_argv(launch.argv, str(rank_dir)), cwd=launch.cwd(rank) or rank_dir, env=full,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                start_new_session=True)
        assert proc.stdout is not None
        self.outputs[rank].follow(proc.stdout)
        self.procs[rank] = proc
        return proc.pid

    def poll(self) -> tuple[Polled, dict[int, str]]:
        return [out.take(p.poll() if p else None) for p, out in zip(self.procs, self.outputs, strict=True)], {}

    def unreachable(self) -> list[int]:
        return []

    def output_tail(self, rank: int) -> str:
        return self.outputs[rank].text()

    def where(self, rank: int) -> str:
        device = "GPU" if self.device_kind == "gpu" else "CPU device"
        return f"rank {rank} ({device} {self.devices[rank]})"

    def hosts(self, ranks: list[int]) -> tuple[str, ...]:
        return ()

    def close(self) -> None:
        for p in self.procs:
            if p is not None:
                kill_session(p.pid)  # the rank and its op build's compilers (their own groups)
                p.wait()
        self._port.close()
