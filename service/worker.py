"""``python -m service.worker``: a scheduler process without the API.

Run one per set of devices (one per Ray cluster, with its ``RAY_ADDRESS``), or several for
the same devices: the lease lets one of them run trials at a time and another takes over
when it dies. SIGTERM or Ctrl-C stops it gracefully (the running trial is rerun on resume).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from types import FrameType

from service.db import Database
from service.scheduler import Scheduler
from service.settings import Settings


def run_worker(settings: Settings) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    db = Database(settings.database_url)
    scheduler = Scheduler(db, settings)
    done = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    scheduler.start()
    done.wait()
    scheduler.stop()
    db.dispose()


def main() -> int:
    from service.admin import main as admin_main

    return admin_main(["worker", *sys.argv[1:]])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
