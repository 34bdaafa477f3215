"""``RankProcess``: a Ray actor that owns one rank's fresh subprocess.

The rank runs in its own process (and session), so an OOM, a crash or a hang takes
nothing else with it, and a kill ends it and its children. The subprocess also dies
with the actor (``PR_SET_PDEATHSIG``), so nothing is left running if the driver goes.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import ray

from workers.cpu_isa import cpu_isa_env
from workers.host.rank_dirs import new_rank_dir
from workers.host.rank_output import RankOutput
from workers.host.script_user import as_user_env, extensions_copy, give_to, protect_ray_files, resolve, user_home
from workers.host.transport import process_env, rank_argv
from workers.host.zygote import ZygoteChild, ensure_zygote
from workers.ops import kill_session
from workers.ports import hold_port

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@ray.remote(num_cpus=1, max_restarts=0)
class RankProcess:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.child: ZygoteChild | None = None
        self.output = RankOutput()
        self.port_hold: socket.socket | None = None
        self.workdir = new_rank_dir()  # and the folders of killed actors go (workers.host.rank_dirs)

    def address(self) -> tuple[str, int]:
        """This node's address and a free port on it (for the rendezvous store), held until
        ``kill`` so nothing else takes it before rank 0 listens (``workers.ports``)."""
        if self.port_hold is None:
            self.port_hold = hold_port("")
        return ray.util.get_node_ip_address(), int(self.port_hold.getsockname()[1])

    def gpu_ids(self) -> list[str]:
        """The GPUs Ray gave this actor (its bundle's ``GPU``); empty on a CPU rank."""
        return [str(g) for g in ray.get_gpu_ids()]

    def prepare(self, argv: list[str], env: dict[str, str]) -> None:
        """Have the node's zygote up before the trial's clock starts (its first start
        imports the whole stack: tens of seconds on a loaded 2-core machine)."""
        full_env = {**os.environ, **cpu_isa_env(), **env}
        if _warm_start(argv, full_env):
            ensure_zygote(cpu_isa_env())

    def start(self, files: dict[str, str], argv: list[str], env: dict[str, str], cwd: str | None = None,
              clean_env: bool = False, run_as: str | None = None) -> int:
        """Start the rank: ``files`` go to its own folder (``$PIPETTE_RANK_DIR`` in ``argv``); it
        runs in ``cwd`` (default that folder). ``clean_env``: a user's script, which gets only
        ``workers.host.script_env.script_environment`` of this process's environment (no service
        credentials), never a shell; ``run_as``: as that OS user, its folder handed to it."""
        for name, text in files.items():
            Path(self.workdir, name).write_text(text)
        argv = rank_argv(argv, self.workdir)
        full_env = process_env(env, clean_env, self.workdir)
        if run_as is not None:
            return self._start_as(run_as, argv, full_env, cwd)
        if _warm_start(argv, full_env):
            # A CPU rank forks from the node's warm zygote (workers.host.zygote): same fresh
            # process per rank and trial, without ~8 CPU-seconds of imports.
            self.child = ZygoteChild(argv[2], argv[3:], full_env, self.workdir, cpu_isa_env())
            self.output.follow(self.child.lines())
            return self.child.pid
        self.proc = subprocess.Popen(
            argv, cwd=cwd or self.workdir, env=full_env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, bufsize=1, start_new_session=True, preexec_fn=_die_with_parent,
        )
        if self.proc.stdout is None:
            raise RuntimeError("no stdout pipe")
        self.output.follow(self.proc.stdout)
        return self.proc.pid

    def _start_as(self, name: str, argv: list[str], env: dict[str, str], cwd: str | None) -> int:
        """Start a tenant's script as the user ``name`` (``workers.host.script_user``): it owns
        its folder and a copy of the op cache, and reads nothing of the service's."""
        user = resolve(name)
        protect_ray_files()
        home = user_home(user)
        env = as_user_env(env, user, home)
        if "TORCH_EXTENSIONS_DIR" in env:
            env["TORCH_EXTENSIONS_DIR"] = extensions_copy(user, env["TORCH_EXTENSIONS_DIR"])
        give_to(self.workdir, user)
        self.proc = subprocess.Popen(
            argv, cwd=cwd or self.workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            bufsize=1, start_new_session=True, preexec_fn=_die_with_parent, user=user.uid, group=user.gid,
            extra_groups=[],
        )
        if self.proc.stdout is None:
            raise RuntimeError("no stdout pipe")
        self.output.follow(self.proc.stdout)
        return self.proc.pid

    def poll(self) -> tuple[list[str], int | None]:
        """Event lines since the last poll, and the exit status (None while running)."""
        code = self.proc.poll() if self.proc else self.child.poll() if self.child else None
        return self.output.take(code)

    def unpack(self, data: bytes) -> str:
        """Unpack the job's working directory (``workers.host.workdir.pack``) here; returns where."""
        from workers.host.workdir import unpack

        return unpack(data, Path(self.workdir, "job"))

    def output_tail(self) -> str:
        return self.output.text()

    def kill(self) -> None:
        if self.child is not None:
            self.child.kill()
        if self.proc is not None:
            # The rank's whole session: ninja gives each compiler of an op build a process group
            # of its own, which a killpg of the rank's misses (they ran on, orphaned: issue 32).
            kill_session(self.proc.pid)
            self.proc.wait()
        if self.port_hold is not None:
            self.port_hold.close()
            self.port_hold = None
        # its files: the candidate's, and a script's unpacked working directory
        shutil.rmtree(self.workdir, ignore_errors=True)


def _warm_start(argv: list[str], env: dict[str, str]) -> bool:
    """Fork from the zygote: CPU ranks of ``python -m workers.*`` (unless PIPETTE_ZYGOTE=0)."""
    return (
        env.get("PIPETTE_ZYGOTE", "1") != "0"
        and env.get("DS_ACCELERATOR") == "cpu"
        and len(argv) >= 3 and argv[1] == "-m" and argv[2].startswith("workers.")
    )
