"""Two Rays on one machine each fork their CPU ranks from a zygote of their own.

A node's zygote (``workers.host.zygote``) is the child of that Ray's host actor and ends with it.
Its socket was named after the interpreter, the code and the import environment only, so a second
Ray on the machine (the other pytest worker's, another user's job) found the first one's zygote and
forked its ranks there; when the first Ray stopped, the zygote went and the second Ray's running
ranks were reported "killed by SIGKILL" (their exit status lost with the server's socket). It made
``test_candidate_runs_and_is_measured`` fail about one run in two when its file shared the run with
another integration file. Here: another Ray (a subprocess) starts its zygote first, this worker's
Ray then asks for its own, the other Ray stops, and this worker's zygote must still answer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from workers.cpu_isa import cpu_isa_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
ROOT = Path(__file__).resolve().parents[2]

OTHER_RAY = """
import sys
import ray
from workers.cpu_isa import cpu_isa_env
from workers.host.ray_cluster import ensure_ray

ensure_ray(num_cpus=1)

@ray.remote(num_cpus=0)
def zygote_up():
    from workers.host.zygote import ensure_zygote, socket_path
    ensure_zygote(cpu_isa_env())
    return socket_path(cpu_isa_env())

print("@@path " + ray.get(zygote_up.remote()), flush=True)
sys.stdin.readline()
ray.shutdown()
print("@@stopped", flush=True)
"""


@ray.remote(num_cpus=0)
def _this_rays_zygote() -> str:
    from workers.host.zygote import ensure_zygote, socket_path

    ensure_zygote(cpu_isa_env())
    return socket_path(cpu_isa_env())


@ray.remote(num_cpus=0)
def _answers(path: str) -> bool:
    from workers.host.zygote import _alive

    return _alive(path)


@ray.remote(num_cpus=0)
def _sweep(theirs: str) -> tuple[bool, bool]:
    from workers.host.zygote import _sweep_ended, socket_path

    ours = socket_path(cpu_isa_env())
    _sweep_ended(Path(theirs).parent)
    return os.path.exists(theirs + ".pid"), os.path.exists(ours + ".pid")


def test_another_rays_stop_leaves_this_rays_zygote_up() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RAY_ADDRESS", None)
    other = subprocess.Popen([sys.executable, "-c", OTHER_RAY], env=env, cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert other.stdout is not None and other.stdin is not None
        line = other.stdout.readline()
        assert line.startswith("@@path "), other.stderr.read() if other.stderr else ""
        theirs = line.split()[1]
        ours = ray.get(_this_rays_zygote.remote(), timeout=360)
        other.stdin.write("stop\n")
        other.stdin.flush()
        assert other.stdout.readline().strip() == "@@stopped"
        assert other.wait(60) == 0
        assert ray.get(_answers.remote(ours), timeout=60), "this Ray's zygote went with the other Ray"
        assert not ray.get(_answers.remote(theirs), timeout=60), "the stopped Ray's zygote outlived it"
        # Its files stayed (a stopped Ray SIGKILLs its zygote); the next server start sweeps them
        # and leaves the live one's.
        assert ray.get(_sweep.remote(theirs), timeout=60) == (False, True)
    finally:
        other.kill()
        other.wait()
