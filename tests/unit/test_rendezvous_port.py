"""The rendezvous port a run holds for its rank 0 (``workers.ports``): nothing else may take it
between its choice and rank 0's listen (a trial failed in CI on ``EADDRINUSE`` so, stop 56), and
rank 0's store, Pipette's or torch's own, still listens on it. A port another process listens on
is said in one line with what to change."""

from __future__ import annotations

import errno
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from workers.ports import hold_port
from workers.rank.store import listen_on, rendezvous_store


@pytest.mark.parametrize("host", ["127.0.0.1", ""])
def test_a_held_port_is_refused_to_a_plain_bind(host: str) -> None:
    with hold_port(host) as held:
        port = held.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError) as e:
            other.bind(("127.0.0.1", port))
        assert e.value.errno == errno.EADDRINUSE


def test_rank_0s_store_listens_on_the_held_port() -> None:
    with hold_port() as held:
        port = held.getsockname()[1]
        listen_on("127.0.0.1", port).close()
        # torch's own store server (a user's script under torchrun) binds with SO_REUSEADDR too
        store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=10))
        store.set("k", "v")
        assert store.get("k") == b"v"


def test_a_port_another_process_listens_on_is_said_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        with pytest.raises(OSError, match=f"rendezvous port {port} of 127.0.0.1 is taken.*MASTER_PORT"):
            rendezvous_store(1, is_master=True, timeout=timedelta(seconds=5))
