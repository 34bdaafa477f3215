"""A rendezvous port held for a run's rank 0 until the run ends.

Picking a free port by binding to port 0 and closing the socket leaves the port free for
anything between then and rank 0's bind (seconds of imports): an outgoing connection of any
process may take it as its source port, and the trial fails with ``EADDRINUSE`` (seen once in
CI, stop 56). The holder binds with ``SO_REUSEADDR`` and never listens, so the kernel gives the
port to no ``connect`` and no plain ``bind``, while rank 0's store, which binds with
``SO_REUSEADDR`` too (``workers.rank.store.listen_on``, through ``bound``; torch's own store server does as well),
can still bind and listen on it (Linux lets a ``SO_REUSEADDR`` socket bind a port another such
socket holds as long as that one does not listen: ``inet_bind_conflict``).
"""

from __future__ import annotations

import socket


def bound(host: str, port: int) -> socket.socket:
    """A TCP socket bound with ``SO_REUSEADDR`` to ``host:port`` (IPv4 or IPv6, as ``host`` resolves;
    ``""``: every interface; port 0: a free one), not listening."""
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def hold_port(host: str = "127.0.0.1") -> socket.socket:
    """A socket holding a free port of ``host`` (``""``: every interface), not listening; the port
    is ``getsockname()[1]``. Close it when the run ends."""
    return bound(host, 0)
