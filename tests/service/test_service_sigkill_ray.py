"""SIGKILL of ``serve`` (issue 43, item 12): the local Ray it started ends within seconds.

Ray's GCS and raylet die with their driver, but the raylet's agents then spent ~60 s trying to
tell the dead GCS, and lived ~65 s with parent 1. The reaper (``workers.host.ray_reaper``)
ends them when the service's end of its pipe closes."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from service.migrations import upgrade
from tests.service.processes import ServiceProcess, admin_token, commands, wait_for
from workers.host.ray_cluster import alive, descendants

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_a_sigkilled_serve_leaves_no_ray_process(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'kill.db'}"
    upgrade(url)
    headers = admin_token(url, tmp_path, "sigkill-test")
    service = ServiceProcess(url, tmp_path, log_name="sigkill")
    try:
        service.start()
        assert service.proc is not None
        pid = service.proc.pid
        c = httpx.Client(base_url=service.base, headers=headers, timeout=30)
        c.post("/v1/clusters", json={"name": "local", "devices": 2})
        c.post("/v1/clusters/local/profile")  # the scheduler starts its local Ray to measure the devices

        def agents() -> bool:
            return sum("agent" in line for line in commands(descendants({pid}))) >= 2

        wait_for(agents, 300, "the local Ray's agents to start", service)
        ray = descendants({pid})
        service.kill()
        killed = time.monotonic()
        left = wait_for(lambda: not alive(ray) or None, 60, "the Ray processes of the killed serve to end")
        took = time.monotonic() - killed
        print(f"the killed serve's {len(ray)} Ray processes ended {took:.1f} s after the SIGKILL")
        assert left and took < 5, f"{took:.1f} s; left: {commands(alive(ray))}"
    finally:
        service.stop()
