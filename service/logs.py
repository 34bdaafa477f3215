"""The service's log: what ``serve`` and ``worker`` print on stderr.

Pipette's own loggers (``pipette.*``: the scheduler, the database's outages and recoveries,
the ops' builds) at INFO; other libraries' at WARNING. uvicorn configures only its own loggers,
so without this ``serve`` dropped every INFO line of Pipette's.
"""

from __future__ import annotations

import logging

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure() -> None:
    """Once per process, before the service starts; a no-op where the root logger has a handler
    already (an embedding application's own configuration wins)."""
    logging.basicConfig(level=logging.WARNING, format=FORMAT)
    pipette = logging.getLogger("pipette")
    if pipette.level == logging.NOTSET:
        pipette.setLevel(logging.INFO)
