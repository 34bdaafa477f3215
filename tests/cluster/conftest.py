"""Fixtures of the multi-host tests: one shaped 4-host Ray cluster for the session
(``tests/cluster/shaped.py``), torn down however the tests end, and its probed profile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.cluster.drive import PREFIX
from tests.cluster.shaped import ClusterError, ShapedCluster, check_permitted

pytest.importorskip("deepspeed")
pytest.importorskip("ray")


@pytest.fixture(scope="session")
def cluster() -> Iterator[ShapedCluster]:
    try:
        check_permitted()
    except ClusterError as e:
        pytest.skip(f"the shaped cluster cannot be built here: {e}")
    # DeepSpeed builds its CPU comm op on first use (about a minute, cached per machine):
    # build it before any trial's timeout runs, as tests/integration does.
    subprocess.run(
        [sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
        env={**os.environ, "DS_ACCELERATOR": "cpu"}, check=True, capture_output=True, timeout=600,
    )
    shaped = ShapedCluster()
    started = time.monotonic()
    shaped.up()
    print(f"\nshaped cluster up in {time.monotonic() - started:.1f} s: {json.dumps(shaped.describe()['links_mbit'])}")
    try:
        yield shaped
    finally:
        shaped.down()


@dataclass
class Driven:
    events: list[dict[str, Any]]
    returncode: int
    output: str

    @property
    def result(self) -> dict[str, Any]:
        found = [e for e in self.events if e["event"] in ("result", "raised")]
        assert found, f"the driver ended ({self.returncode}) without a result:\n{self.output[-4000:]}"
        return found[-1]


def drive(cluster: ShapedCluster, args: list[str], timeout_s: float,
          on_event: Callable[[dict[str, Any]], None] | None = None) -> Driven:
    """Run ``python -m tests.cluster.drive ARGS`` in host 0 as a Ray driver of the cluster."""
    proc = cluster.popen(0, [sys.executable, "-m", "tests.cluster.drive", *args],
                         env={"RAY_ADDRESS": cluster.ray_address},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    events: list[dict[str, Any]] = []
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith(PREFIX):
                event = json.loads(line[len(PREFIX):])
                events.append(event)
                if on_event is not None:
                    on_event(event)
            if time.monotonic() > deadline:
                raise AssertionError(f"the driver ran past {timeout_s:g} s:\n{''.join(lines)[-4000:]}")
        proc.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return Driven(events, proc.returncode, "".join(lines))


@pytest.fixture(scope="session")
def probed(cluster: ShapedCluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """The profile the cluster probe measured across the 4 hosts (path), and its seconds."""
    out = tmp_path_factory.mktemp("probe") / "profile.json"
    run = drive(cluster, ["probe", "--out", str(out), "--timeout", "300"], timeout_s=420)
    assert run.returncode == 0 and run.result["event"] == "result", run.output[-4000:]
    return out, float(run.result["seconds"])
