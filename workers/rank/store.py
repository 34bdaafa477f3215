"""The ranks' rendezvous store (torch's ``TCPStore``), listening only where its ranks reach it.

torch's store server listens on every interface, whatever ``MASTER_ADDR`` says, and takes any
connection without authentication: anyone who can reach the node could read or write a trial's
rendezvous while it runs. Rank 0 here binds the listening socket itself, to ``MASTER_ADDR``
(loopback for a single-node trial, the node's cluster address for a multi-node one; the
executor chooses it), and hands it to the store (``master_listen_fd``).
"""

from __future__ import annotations

import errno
import os
import socket
import sys
from datetime import timedelta

import torch.distributed as dist

from workers.ports import bound

#: what a listening socket of torch's store queues (its own default)
BACKLOG = 2048


def listen_on(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (IPv4 or IPv6, as ``host`` resolves) and listening."""
    sock = bound(host, port)
    try:
        sock.listen(BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def rendezvous_store(world: int, is_master: bool, timeout: timedelta) -> dist.TCPStore:
    """The store at ``MASTER_ADDR:MASTER_PORT``; rank 0 serves it on that address only. Under
    torchrun (``TORCHELASTIC_USE_AGENT_STORE``) the first node's agent serves it there already,
    and every rank is a client, as ``torch.distributed.rendezvous._create_c10d_store`` does."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    if not is_master or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    try:
        sock = listen_on(host, port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:  # every interface would not do better: say what to change
            raise OSError(e.errno, f"the rendezvous port {port} of {host} is taken by another process; "
                          "give the run a free one (MASTER_PORT)") from e
        # MASTER_ADDR is not an address of this host (a launcher's NAT name): torch's own
        # server, on every interface, rather than no trial at all; said once in the rank's log.
        print(f"pipette: the rendezvous store cannot listen on {host}:{port} only ({e}); "
              "it listens on every interface", file=sys.stderr, flush=True)
        return dist.TCPStore(host, port, world, is_master=True, timeout=timeout)
    # The store owns the socket from here (it closes it with the server).
    return dist.TCPStore(host, port, world, is_master=True, timeout=timeout, master_listen_fd=sock.detach())
