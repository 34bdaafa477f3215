"""The ranks' rendezvous store listens on loopback for a single-node trial (issue 32, item 14),
for Pipette's own ranks and for a user's script (its ``init_process_group``'s ``env://``
store). Before the fix torch's store server listened on every interface (``0.0.0.0`` /
``::``), open to anyone who could reach the node, without authentication."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pipette.config import ParallelConfig
from pipette.model import ModelSpec
from pipette.script import ScriptSpec
from pipette.training import TrainingSpec
from workers.host.executor import StepReport, run_trial
from workers.host.ray_cluster import store_host
from workers.spec import TrialSpec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
WILDCARD = {"0.0.0.0", "::"}


def _trial(script: ScriptSpec | None = None) -> TrialSpec:
    training = TrainingSpec(global_batch=8, seq_len=32, dtype="fp32")
    config = ParallelConfig(tp=1, pp=1, dp=2, mbs=2, global_batch=8, zero_stage=1, recompute="none")
    # enough steps that rank 0 is still alive when a step report reaches the test: the reports come a
    # poll at a time, and 8 steps of tiny-llama (~0.4 s) could all be over, rank 0 gone, before the first
    # poll delivered them (about half the runs on the 2-core VM failed so, 2026-12-05); 60 take seconds
    return TrialSpec(ModelSpec.preset("tiny-llama"), training, config, warmup_steps=1, min_steps=60, max_steps=60,
                     script=script)


def listening(pid: int) -> list[str]:
    """``ADDRESS:PORT`` of every TCP socket process ``pid`` listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, size in (("tcp", 4), ("tcp6", 16)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            raw, port = fields[1].split(":")
            out.append(f"{_address(bytes.fromhex(raw), size)}:{int(port, 16)}")
    return out


def _address(raw: bytes, size: int) -> str:
    import ipaddress

    # /proc/net/tcp* write the address as 32-bit words in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))
    address = ipaddress.ip_address(words)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def _run(spec: TrialSpec) -> list[str]:
    found: list[str] = []

    def on_step(report: StepReport) -> None:
        if found:
            return
        try:
            found.extend(listening(report.pids[0]))
        except (FileNotFoundError, ProcessLookupError):
            pass  # rank 0 ended between its report and this read: the next report tries again

    m = run_trial(spec, timeout_s=240, on_step=on_step)
    assert m.status == "ok", m.error
    return found


@pytest.mark.parametrize("kind", ["runner", "script"])
def test_a_single_node_trials_store_listens_on_loopback_only(kind: str) -> None:
    script = ScriptSpec(argv=("python", "ds_tiny.py"), kind="deepspeed", workdir=str(SCRIPTS))
    found = _run(_trial(script if kind == "script" else None))
    assert found, "rank 0 listened on nothing: its store was not found"
    wide = [a for a in found if a.rsplit(":", 1)[0] in WILDCARD]
    assert not wide, f"rank 0 listens on every interface: {wide} (all: {found})"
    assert any(a.startswith("127.0.0.1:") for a in found), found


def test_the_store_is_on_loopback_for_one_node_and_on_rank_0s_node_for_several() -> None:
    assert store_host("10.0.0.5", ["10.0.0.5", "10.0.0.5"]) == "127.0.0.1"
    assert store_host("10.0.0.5", ["10.0.0.5", "10.0.0.6"]) == "10.0.0.5"
