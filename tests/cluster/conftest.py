"""Fixtures of the multi-host tests: one shaped 4-host Ray cluster for the session
(``tests/cluster/shaped.py``), torn down however the tests end; the service on it as the compose
file deploys it (``tests/cluster/stack.py``); and the profile its scheduler measured, which both
files read (one probe of the 4 hosts per session, not one per file)."""

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
from tests.cluster.stack import ComposeStack, parse_json

pytest.importorskip("deepspeed")
pytest.importorskip("ray")


@pytest.fixture(scope="session")
def cluster() -> Iterator[ShapedCluster]:
    try:
        check_permitted()
    except ClusterError as e:
        pytest.skip(f"the shaped cluster cannot be built here: {e}")
    # DeepSpeed builds its CPU comm op on first use (about a minute, cached per machine):
    # build it before any trial's timeout runs, in the cache the ranks use
    # (``pipette.contract.build_environment``; DeepSpeed's default folder is not theirs).
    subprocess.run(
        [sys.executable, "-c", "from workers.ops import build_ops; build_ops('cpu')"],
        env={**os.environ, "DS_ACCELERATOR": "cpu"}, check=True, capture_output=True, timeout=600,
    )
    # PIPETTE_SHAPED_PREFIX: the namespaces' prefix, so two checkouts can run these tests at once
    shaped = ShapedCluster(prefix=os.environ.get("PIPETTE_SHAPED_PREFIX", "pcl"))
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
def stack(cluster: ShapedCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    started = time.monotonic()
    s = ComposeStack(cluster, tmp_path_factory.mktemp("stack")).up()
    print(f"\ncompose processes up in {time.monotonic() - started:.1f} s")
    try:
        yield s
    finally:
        s.down()
        print("scheduler log tail:\n" + s.log("scheduler")[-1500:])


@pytest.fixture(scope="session")
def token(stack: ComposeStack) -> str:
    out = stack.run("api", [sys.executable, "-m", "service.admin", "token", "create", "--tenant", "team",
                            "--name", "cluster-test", "--json"], timeout=60)
    return str(parse_json(out)["token"])


@dataclass
class Profiled:
    """What the scheduler's probe measured across the 4 hosts, and its seconds."""

    profile: dict[str, Any]
    seconds: float


@pytest.fixture(scope="session")
def profiled(stack: ComposeStack, token: str, cluster: ShapedCluster) -> Profiled:
    """Register the cluster by its GCS address and have the scheduler measure it (through Ray
    Client, ``workers.host.probe.probe_cluster``)."""
    parse_json(stack.pipette(token, "cluster", "add", "shaped", "--ray", cluster.ray_address, "--devices", "1",
                             "--json"))
    started = time.monotonic()
    measured = parse_json(stack.pipette(token, "cluster", "profile", "shaped", "--wait", "--timeout", "600",
                                        "--json", timeout=660))
    seconds = time.monotonic() - started
    print(f"profiled by the scheduler through Ray Client in {seconds:.1f} s")
    assert measured["state"] == "succeeded", measured
    return Profiled(dict(measured["profile"]), seconds)


@pytest.fixture(scope="session")
def probed(profiled: Profiled, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float]:
    """The scheduler's profile as a file a driver reads (``drive.py trial --profile``), and its seconds."""
    out = tmp_path_factory.mktemp("probe") / "profile.json"
    out.write_text(json.dumps(profiled.profile))
    return out, profiled.seconds
