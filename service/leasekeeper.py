"""Keep a lease alive while its work runs: renew it every third of its time to live.

If renewing fails for longer than the lease lives (the database is unreachable) or finds the
lease taken (this process was presumed dead), ``lost`` is set and the work must stop: another
scheduler may already be running trials on the same devices.
"""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy.exc import SQLAlchemyError

from service.db import Database
from service.repositories import leases

log = logging.getLogger("pipette.service")


class LeaseKeeper:
    def __init__(self, db: Database, resource: str, holder: str, ttl_s: float) -> None:
        self.db = db
        self.resource = resource
        self.holder = holder
        self.ttl_s = ttl_s
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{resource}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.ttl_s)

    def release(self) -> None:
        try:
            with self.db.write() as session:
                leases.release(session, self.resource, self.holder)
        except SQLAlchemyError:
            log.warning("could not release the lease of %s; it expires in %.0f s", self.resource, self.ttl_s)

    def _run(self) -> None:
        last_ok = time.monotonic()
        while not self._stop.wait(self.ttl_s / 3):
            try:
                with self.db.write() as session:
                    held = leases.renew(session, self.resource, self.holder, self.ttl_s)
            except SQLAlchemyError as e:
                log.warning("lease renewal of %s failed: %s", self.resource, e)
                if time.monotonic() - last_ok > self.ttl_s:
                    self.lost.set()
                    return
                continue
            if not held:
                log.error("lost the lease of %s (it expired and was taken)", self.resource)
                self.lost.set()
                return
            last_ok = time.monotonic()
