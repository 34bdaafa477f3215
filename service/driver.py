"""Drive one job under its lease: profile -> plan -> tune, writing everything as it happens.

The tuner (``pipette.tuner.Tuner``) runs in this thread; its events are written to the
database at once (a trial row per trial, every step, every event), so a reader of the API or
the event stream sees the job live from any process, and a restarted service finds all of it.

Resume: a job taken again after its holder died is rebuilt from its stored trials
(``Tuner(history=...)``); a trial that was running is marked ``interrupted`` and, never having
been recorded, is proposed again under the same number, so nothing is lost or duplicated.
A graceful stop (the service shutting down, or the lease lost) interrupts the running trial the
same way instead of recording the tuner's "cancelled" prune as its outcome, and the ``stopped``
event says the job resumes; the ``resumed`` event lists every trial that reruns.

Tuning time is charged to the job as it passes (every ``CHARGE_EVERY_S``, from a thread of its
own, whatever the trial is doing), so a SIGKILL of the service loses at most that much of it.
Cancel is checked by the trial itself while it runs (``RayTrialRunner.should_stop``), not only
at its steps: a trial that has no step yet (imports, rendezvous, an op build) stops within a
second too.

A lost Ray node: the trial running on it ends ``failed`` naming the rank and node; the job
stays ``running`` and waits for the node (event ``waiting_for_nodes``, ``progress.waiting_for_nodes``)
before the next trial, which reruns the failed one (``pipette.retry.LOST_NODE_RETRIES``); after
``PIPETTE_NODE_WAIT_S`` without it the job fails, every trial kept.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from pipette.cluster import ClusterProfile
from pipette.clusterfile import cluster_from_dict
from pipette.config import ParallelConfig
from pipette.errors import PipetteError
from pipette.model import ModelSpec
from pipette.options import defaults
from pipette.plan import DEFAULT_MARGIN, Plan, make_plan
from pipette.registry import TrialKind, job_kind
from pipette.result_text import result_dict
from pipette.training import TrainingSpec
from pipette.trials import TrialRecord
from pipette.tune_result import TuneResult
from pipette.tuner import Tuner
from service.db import Database
from service.errors import stored_error
from service.leasekeeper import LeaseKeeper
from service.models import FINAL_STATES, Cluster, Job, Profile, utcnow
from service.outage import OUTAGE, is_unavailable
from service.planning import plan_dict
from service.profiling import measure
from service.redact import Redactor, service_secrets
from service.repositories import clusters as cluster_repo
from service.repositories import events, trials
from service.repositories.jobs import set_state
from service.settings import Settings
from service.specs import tune_options

if TYPE_CHECKING:
    from workers.host.runner import RayTrialRunner

log = logging.getLogger("pipette.service")

#: How often the driver reads the job's cancel flag while a trial runs (seconds).
CANCEL_POLL_S = 0.5
#: How often the running tuning time is added to the job (seconds): what a SIGKILL may lose.
CHARGE_EVERY_S = 2.0
#: Jobs this process let go when the database became unreachable, with the driver's error: its
#: resume (once the database is back) says so in the job's events, which it could not write then.
LOST_DATABASE: dict[str, str] = {}


@dataclass(frozen=True)
class StoredJob:
    """What a job runs, as its row stores it, read when the driver takes the job."""

    model: ModelSpec
    training: TrainingSpec
    #: the tuning options, each one the job was stored without at its default
    options: dict[str, Any]
    #: the profile it planned with (a resumed job), else None
    profile_id: str | None
    cluster_row: Cluster
    kind: TrialKind


class Interrupted(Exception):
    """The work must stop without an outcome (shutdown, lease lost); it resumes elsewhere."""


class JobDriver:
    def __init__(
        self, db: Database, settings: Settings, job_id: str, keeper: LeaseKeeper, shutdown: threading.Event,
        *, resumed: bool = False,
    ) -> None:
        self.db = db
        self.settings = settings
        self.job_id = job_id
        self.keeper = keeper
        self.shutdown = shutdown
        self.resumed = resumed
        self.interrupt_reason: str | None = None
        self.cancelled = False
        self._cancel_checked = 0.0
        self._trial_started: dict[int, float] = {}
        self._waiting: list[str] | None = None
        self._waiting_since = 0.0
        #: tuning time is charged to the job as it passes (``_charge_while``), not at the end
        #: only: a SIGKILL skips any ``finally`` (issue 17 item 16, issue 32 item 15)
        self._charged_until: float | None = None
        self._charge_lock = threading.Lock()

    # ---- the job ------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        except Interrupted:
            log.info("job %s interrupted (%s); it resumes when a scheduler takes it again",
                     self.job_id, self.interrupt_reason)
        except SQLAlchemyError as e:
            # The database went away: nothing can be recorded, not even a failure. The lease
            # expires and the job resumes from what was stored.
            if not is_unavailable(e):
                log.exception("job %s: database error; leaving it to resume", self.job_id)
            else:
                self._lost_database(e)
        except PipetteError as e:
            self._finish("failed", error=stored_error(e), stop_reason="error")
        except Exception as e:
            log.exception("job %s failed unexpectedly", self.job_id)
            self._finish("failed", error=stored_error(e, "see the service log; resubmit the job", "internal error: "),
                         stop_reason="error")
        finally:
            # the unpacked working directory: unpacked again by whoever resumes the job
            from service.scripts import remove_job_files

            remove_job_files(self.settings.home, self.job_id)

    def _lost_database(self, error: SQLAlchemyError) -> None:
        """One line, no traceback: the database is unreachable, so the job is let go (its lease
        expires) and resumed from what was stored once it is back."""
        reason = str(getattr(error, "orig", None) or error).strip().splitlines()[0][:200]
        LOST_DATABASE[self.job_id] = reason
        OUTAGE.failed(error, f"job {self.job_id}")
        log.warning("job %s: the database became unreachable (%s); it resumes from what was stored once the "
                    "database is back", self.job_id, reason)

    def _run(self) -> None:
        job = self._take_job()
        if job is None:
            return
        cluster, profile_id = self._cluster(job.cluster_row, job.profile_id)
        self._check_interrupt()

        with self.db.write() as session:
            set_state(session, self._job(session), "planning", profile_id=profile_id)
        runner = self._trial_runner(job, cluster)
        plan, planned = _plan_job(job, cluster, runner.refusals)

        history, prior, used = self._start_running(job, planned)
        self._check_interrupt()

        tune = tune_options(job.options, used)
        tuner = Tuner(plan, tune, history=history, prior=prior, runnable=runner.refusals)
        with self._charging():
            result = tuner.run(runner, on_event=self.on_event, should_stop=self.should_stop)
        self._check_interrupt()
        self._finish_tuned(result)

    def _take_job(self) -> StoredJob | None:
        """Take the job for this attempt (its running trials marked interrupted; on resume, said so in
        its events) and read what it runs; None: it is over, or cancelled now."""
        with self.db.write() as session:
            job = self._job(session)
            if job.state in FINAL_STATES:
                return None
            if job.cancel_requested:
                set_state(session, job, "cancelled", stop_reason="cancelled")
                return None
            rerun = trials.interrupt_running(session, job.id)
            job.attempts += 1
            job.worker = self.keeper.holder
            job.started_at = job.started_at or utcnow()
            if self.resumed:
                _say_resumed(session, job, rerun)
            model = ModelSpec.from_dict(job.model)
            training = TrainingSpec.from_dict(job.training)
            # a job stored before an option existed gets its default
            options: dict[str, Any] = {**defaults("tune"), **job.options}
            profile_id = job.profile_id
            cluster_row = session.get(Cluster, job.cluster_id)
            assert cluster_row is not None  # a foreign key
            from service.scripts import unpack_for_job

            script = unpack_for_job(job.script, job.script_files, self.settings.home, job.id,
                                    self.settings.script_user)
            kind = job_kind(options.get("stack"), script)
            return StoredJob(model, training, options, profile_id, cluster_row, kind)

    def _trial_runner(self, job: StoredJob, cluster: ClusterProfile) -> RayTrialRunner:
        """The runner of the job's trials on ``cluster``, stopped by ``should_stop``, waiting for lost nodes."""
        from workers.host.runner import RayTrialRunner

        options, kind = job.options, job.kind
        timeout = float(options["trial_timeout_s"] or self.settings.trial_timeout_s)
        steps = int(options["steps"])
        return RayTrialRunner(job.model, job.training, cluster, device_kind=cluster.device_spec.kind,
                              timeout_s=timeout, max_steps=steps, min_steps=min(3, steps), seed=int(options["seed"]),
                              node_wait_s=self.settings.node_wait_s, on_wait=self.on_wait,
                              script=kind.script, ship_workdir=kind.ships_workdir,
                              should_stop=self.should_stop, stack=kind.runner_stack)

    def _start_running(self, job: StoredJob, planned: dict[str, Any]) -> tuple[list[TrialRecord], list[TrialRecord],
                                                                                float]:
        """The job ``running`` with its plan; its own trials so far, the other jobs' it learns from, and
        the tuning seconds it has used."""
        with self.db.write() as session:
            row = self._job(session)
            history = trials.SqlTrialStore(session, row.id).records()
            # Which other jobs' trials tell about this one is the trial kind's answer (pipette.registry).
            prior = trials.prior_records(session, job.cluster_row.resource, exclude_job=row.id) \
                if job.kind.learns_from_other_jobs else []
            used = row.tuning_s
            set_state(session, row, "running", plan=planned)
        return history, prior, used

    def _finish_tuned(self, result: TuneResult) -> None:
        """The job's outcome once the tuner stopped: cancelled, succeeded with a best, or failed."""
        outcome = result_dict(result)
        outcome.pop("trials", None)  # every attempt is in the trials table already
        best = _best_summary(result.best) if result.best is not None else None
        if self.cancelled:
            state = "cancelled"
        elif best is not None:
            state = "succeeded"
        else:
            state = "failed"
        error = None
        if state == "failed":
            error = {"message": f"no trial ran ok ({len(result.trials)} tried; stop: {result.stop_reason})",
                     "field": None, "fix": "see the trials' errors (GET /v1/jobs/{id}/trials)"}
        self._finish(state, result=outcome, best=best, stop_reason=result.stop_reason, error=error)

    # ---- the tuner's callbacks --------------------------------------------------------
    def on_event(self, event: Any) -> None:
        """A ``TuneEvent``: store it (and the trial it concerns) at once."""
        kind, number, data = event.kind, event.trial, dict(event.data or {})
        record = event.record if kind == "trial_ended" else None
        if kind != "trial_step":  # a trial's output and errors: no secret of the service's stored
            secrets = self._secrets()
            data = secrets.data(data)
            if record is not None and secrets.found(record.to_dict()):
                record = TrialRecord.from_dict(secrets.data(record.to_dict()))
        with self.db.write() as session:
            job = self._job(session)
            if kind == "trial_started" and number is not None:
                trials.start_trial(session, job.id, number, label=str(data.get("label", "")),
                                   config=dict(data.get("config") or {}),
                                   predicted_step_time=_float(data.get("predicted_step_time")),
                                   attempt=int(data.get("attempt", 1)))
                job.progress = {**(job.progress or {}), "running_trial": number}
            elif kind == "trial_step" and number is not None:
                trials.add_step(session, job.id, number, {k: data.get(k) for k in ("step", "time", "warmup", "loss")})
            elif kind == "trial_ended" and number is not None:
                record = record or TrialRecord.from_dict(data)
                if self.interrupt_reason is not None and _cancel_prune(record):
                    trials.interrupt_trial(session, job.id, number)
                    events.add_event(session, job.id, "trial_interrupted", {"reason": self.interrupt_reason},
                                     trial=number)
                    return
                trials.SqlTrialStore(session, job.id).append(record)
                _add_seconds(session, job.id, self._uncharged())
                self._update_progress(session, job)
            elif kind == "stopped" and self.interrupt_reason is not None:
                # not the tuner's "cancelled": the job is not over, it goes on after the restart
                data = {**data, "resumes": True, "reason": f"{self.interrupt_reason}: the job resumes when a scheduler "
                                                           "takes it again, rerunning its interrupted trial"}
            events.add_event(session, job.id, kind, data, trial=number)

    def on_wait(self, missing: list[str] | None) -> bool:
        """The runner waits for lost nodes before a trial (``missing``; ``None`` once they are
        back): say so once, in an event and in the job's progress, and stop waiting when the
        job must stop."""
        if missing != self._waiting:
            with self.db.write() as session:
                job = self._job(session)
                progress = dict(job.progress or {})
                if missing is None:
                    waited = time.monotonic() - self._waiting_since
                    progress.pop("waiting_for_nodes", None)
                    events.add_event(session, job.id, "nodes_back", {"waited_s": round(waited, 1)})
                else:
                    self._waiting_since = self._waiting_since if self._waiting else time.monotonic()
                    progress["waiting_for_nodes"] = missing
                    events.add_event(session, job.id, "waiting_for_nodes", {
                        "missing": missing, "limit_s": self.settings.node_wait_s})
                job.progress = progress
            self._waiting = missing
        return self.should_stop()

    def should_stop(self) -> bool:
        if self.shutdown.is_set():
            self.interrupt_reason = "the service is stopping"
        elif self.keeper.lost.is_set():
            self.interrupt_reason = "the cluster's lease was lost"
        if self.interrupt_reason is not None:
            return True
        now = time.monotonic()
        if not self.cancelled and now - self._cancel_checked > CANCEL_POLL_S:
            self._cancel_checked = now
            with self.db.read() as session:
                job = session.get(Job, self.job_id)
                self.cancelled = bool(job is None or job.cancel_requested)
        return self.cancelled

    # ---- steps --------------------------------------------------------------------
    def _cluster(self, row: Cluster, profile_id: str | None) -> tuple[ClusterProfile, str]:
        """The job's profile: the one it planned with (resume), else the cluster's latest, else
        measure the cluster now (state ``profiling``)."""
        with self.db.read() as session:
            profile = session.get(Profile, profile_id) if profile_id else None
            if profile is None:
                profile = cluster_repo.latest_profile(session, row.id)
        if profile is not None and profile.profile is not None:
            return cluster_from_dict(profile.profile), profile.id
        with self.db.write() as session:
            set_state(session, self._job(session), "profiling")
            profile = cluster_repo.request_profile(session, row)
            profile.state, profile.started_at = "running", utcnow()
            new_id = profile.id
        try:
            measured = measure(row)
        except Exception as e:
            record_profile(self.db, new_id, error=stored_error(e))
            raise
        record_profile(self.db, new_id, profile=measured.to_dict())
        return measured, new_id

    def _check_interrupt(self) -> None:
        self.should_stop()
        if self.interrupt_reason is not None:
            raise Interrupted(self.interrupt_reason)

    def _secrets(self) -> Redactor:
        """Built anew each time: Ray's token file is written when Ray starts, after the job did."""
        return service_secrets(self.settings.database_url, self.settings.metrics_token)

    def _finish(self, state: str, **fields: Any) -> None:
        fields = self._secrets().data(fields)
        with self.db.write() as session:
            job = self._job(session)
            if job.state in FINAL_STATES:
                return
            progress = dict(job.progress or {})
            progress["running_trial"] = None
            best = fields.pop("best", None)
            set_state(session, job, state, progress=progress, **fields)
            # a trial whose run raised (its runner's error ended the job) ends with the job
            error = fields.get("error") or {}
            trials.end_running(session, job.id, "failed" if state == "failed" else "pruned",
                               f"the job ended {state}" + (f": {error['message']}" if error.get("message") else ""))
            if best is not None:
                job.best = best
            events.add_event(session, job.id, "finished", {"state": state, "stop_reason": fields.get("stop_reason"),
                                                          "best": job.best, "error": fields.get("error")})

    def _update_progress(self, session: Session, job: Job) -> None:
        rows = trials.list_trials(session, job.id)
        done = [t for t in rows if t.state not in ("running", "interrupted")]
        ok = [t for t in done if t.state == "ok" and t.measured_step_time]
        job.progress = {"trials_done": len(done), "trials_ok": len(ok), "running_trial": None,
                        "max_trials": int(job.options.get("max_trials", 0))}
        best = trials.row_record(min(ok, key=lambda t: float(t.measured_step_time or 0.0))) if ok else None
        if best is not None:
            job.best = _best_summary(best)

    @contextlib.contextmanager
    def _charging(self) -> Iterator[None]:
        """Charge the tuning time inside to the job every ``CHARGE_EVERY_S`` and at the end."""
        self._charged_until = time.monotonic()
        done = threading.Event()
        charger = threading.Thread(target=self._charge_until, args=(done,), name=f"charge-{self.job_id}",
                                   daemon=True)
        charger.start()
        try:
            yield
        finally:
            done.set()
            charger.join()
            self._add_tuning_time(self._uncharged())
            self._charged_until = None

    def _charge_until(self, done: threading.Event) -> None:
        while not done.wait(CHARGE_EVERY_S):
            self._add_tuning_time(self._uncharged())

    def _uncharged(self) -> float:
        """Seconds of tuning since they were last added to the job (and mark them added)."""
        with self._charge_lock:
            if self._charged_until is None:
                return 0.0
            now = time.monotonic()
            seconds, self._charged_until = now - self._charged_until, now
            return seconds

    def _add_tuning_time(self, seconds: float) -> None:
        try:
            with self.db.write() as session:
                _add_seconds(session, self.job_id, seconds)
        except SQLAlchemyError:
            # kept for the next charge: the time is not lost while the database is away
            with self._charge_lock:
                if self._charged_until is not None:
                    self._charged_until -= seconds
            log.warning("job %s: could not add %.1f s of tuning time", self.job_id, seconds)

    def _job(self, session: Session) -> Job:
        job = session.get(Job, self.job_id)
        if job is None:
            raise Interrupted("the job was deleted")
        return job


def _add_seconds(session: Session, job_id: str, seconds: float) -> None:
    """Add to the job's tuning time in the database itself: the charger thread and the driver
    both add, and neither may overwrite the other's sum with its own stale copy."""
    if seconds > 0:
        session.execute(update(Job).where(Job.id == job_id).values(tuning_s=Job.tuning_s + seconds))


def _say_resumed(session: Session, job: Job, rerun: list[int]) -> None:
    """The dead holder's trial never got its end: say it was interrupted, so its step events in the
    stream are closed the way a graceful stop closes them; then every trial that reruns."""
    lost = LOST_DATABASE.pop(job.id, None)
    reason = (f"the database was unreachable mid-trial ({lost}); rerun on resume" if lost else
              "its service stopped mid-trial; rerun on resume")
    for number in rerun:
        events.add_event(session, job.id, "trial_interrupted", {"reason": reason}, trial=number)
    # every trial to rerun: a dead holder's, and those a graceful stop interrupted
    events.add_event(session, job.id, "resumed", {
        "attempt": job.attempts, "interrupted_trials": trials.interrupted_numbers(session, job.id)})


def _plan_job(job: StoredJob, cluster: ClusterProfile,
              refusals: Callable[[ParallelConfig], list[str]]) -> tuple[Plan, dict[str, Any]]:
    """The job's plan on ``cluster``, and as the job stores it (with the seconds planning took)."""
    start = time.perf_counter()
    options = job.options
    margin = DEFAULT_MARGIN if options["margin"] is None else float(options["margin"])
    plan = make_plan(job.model, job.training, cluster, margin=margin, seed=int(options["seed"]),
                     stack=options.get("stack"))  # a job stored before stacks: Pipette's runner
    return plan, plan_dict(plan, planning_seconds=time.perf_counter() - start, refusals=refusals)


def record_profile(db: Database, profile_id: str, *, profile: dict[str, Any] | None = None,
                   error: dict[str, Any] | None = None) -> None:
    with db.write() as session:
        row = session.get(Profile, profile_id)
        if row is None:
            return
        row.state = "failed" if error else "succeeded"
        row.profile = profile
        row.error = error
        row.finished_at = utcnow()


def _best_summary(record: TrialRecord) -> dict[str, Any]:
    m = record.measurement
    return {
        "trial": record.number, "label": record.label, "config": record.config.to_dict(),
        "measured_step_time": m.step_time, "tokens_per_s": m.tokens_per_s,
        "predicted_step_time": record.predicted_step_time,
    }


def _cancel_prune(record: TrialRecord) -> bool:
    """The tuner's record of a trial it stopped because ``should_stop`` said so."""
    return record.status == "pruned" and "cancel" in record.measurement.error


def _float(value: Any) -> float | None:
    try:
        return None if value is None else float(value)
    except (TypeError, ValueError):
        return None
