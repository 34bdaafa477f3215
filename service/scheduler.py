"""The scheduler: take work for this process's devices, run it under the devices' lease, repeat.

One thread per process (in the API process, or ``pipette-admin worker``: ``run_worker``): a
process has one Ray connection, so it drives one set of devices (``Settings.resource_key``),
and the lease lets one job at a time run trials there. Queued jobs and profile requests wait
their turn in submission order; a job whose holder died (its lease expired while it was
active) is resumed before anything new starts.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from types import FrameType

from sqlalchemy.exc import SQLAlchemyError

from pipette.errors import PipetteError
from service.db import Database
from service.driver import JobDriver, record_profile
from service.errors import stored_error
from service.leasekeeper import LeaseKeeper
from service.logs import configure as configure_logging
from service.models import Cluster, Profile, utcnow
from service.outage import OUTAGE, is_unavailable
from service.profiling import measure
from service.repositories import leases
from service.repositories.leases import Work
from service.settings import Settings

log = logging.getLogger("pipette.service")

#: the longest idle wait while claims keep failing (seconds)
MAX_BACKOFF_S = 30.0


class Scheduler:
    def __init__(self, db: Database, settings: Settings) -> None:
        self.db = db
        self.settings = settings
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.shutdown = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="pipette-scheduler", daemon=True)
        #: failed claims in a row: the idle wait backs off while the database is down
        self._failures = 0

    def start(self) -> None:
        with self.db.write() as session:
            leases.ensure_lease(session, self.settings.resource_key)
        self._thread.start()
        log.info("scheduler %s serves %s", self.holder, self.settings.resource_key)

    def request_stop(self) -> None:
        """Take no more work and interrupt the running job; returns at once (a signal handler
        calls it). ``stop`` then waits for the thread."""
        self.shutdown.set()
        self._wake.set()

    def stop(self, timeout_s: float = 120.0) -> None:
        """Stop taking work; interrupt the running job (its trial is rerun on resume)."""
        self.request_stop()
        asked = time.monotonic()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        if "workers.host.ray_cluster" in sys.modules:  # this process drove trials: a local Ray it started goes too
            from workers.host.ray_cluster import stop_local_ray

            work_s = time.monotonic() - asked
            stop_local_ray()
            log.info("scheduler %s stopped: its work in %.1f s, its local Ray in %.1f s", self.holder, work_s,
                     time.monotonic() - asked - work_s)

    def kick(self) -> None:
        self._wake.set()

    def run_once(self) -> Work | None:
        """Claim one piece of work and run it to its end; None when there was none."""
        try:
            with self.db.write() as session:
                work = leases.claim(session, self.settings.resource_key, self.holder, self.settings.lease_ttl_s)
        except SQLAlchemyError as e:
            if not is_unavailable(e):
                log.warning("claim failed: %s", e)
            else:
                OUTAGE.failed(e, "the scheduler")
            self._failures += 1
            return None
        self._failures = 0
        OUTAGE.recovered()
        if work is None:
            return None
        keeper = LeaseKeeper(self.db, work.resource, self.holder, self.settings.lease_ttl_s)
        keeper.start()
        try:
            if work.kind == "job":
                log.info("%s job %s", "resuming" if work.resumed else "starting", work.id)
                JobDriver(self.db, self.settings, work.id, keeper, self.shutdown, resumed=work.resumed).run()
            else:
                self._profile(work.id)
        finally:
            keeper.stop()
            keeper.release()
        return work

    def _loop(self) -> None:
        while not self.shutdown.is_set():
            try:
                ran = self.run_once()
            except Exception:
                log.exception("scheduler error")
                ran = None
            if ran is None:
                self._wake.wait(self.wait_s())
                self._wake.clear()

    def wait_s(self) -> float:
        """How long an idle scheduler waits before it looks for work again: ``poll_s``, doubled
        after each failed claim in a row up to ``MAX_BACKOFF_S`` (the database is down)."""
        backoff: float = self.settings.poll_s * 2.0 ** min(self._failures, 16)
        return min(backoff, max(MAX_BACKOFF_S, self.settings.poll_s))

    def _profile(self, profile_id: str) -> None:
        with self.db.write() as session:
            profile = session.get(Profile, profile_id)
            if profile is None:
                return
            profile.state, profile.started_at = "running", utcnow()
            cluster = session.get(Cluster, profile.cluster_id)
            assert cluster is not None
        try:
            measured = measure(cluster)
        except PipetteError as e:
            record_profile(self.db, profile_id, error=stored_error(e))
            return
        except Exception as e:
            log.exception("profile %s failed", profile_id)
            record_profile(self.db, profile_id, error=stored_error(e))
            return
        record_profile(self.db, profile_id, profile=measured.to_dict())


def run_worker(settings: Settings) -> None:
    """This process as a scheduler without the API (``pipette-admin worker``), until SIGTERM or
    Ctrl-C stops it gracefully."""
    configure_logging()
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
