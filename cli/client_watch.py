"""``pipette watch JOB``: follow a job live from its server-sent event stream.

Each trial is printed as it starts and ends, with what was predicted and measured; a progress
line (a bar of trials against the budget, the best so far, the running trial's last step) is
redrawn in place on a terminal and printed after each trial otherwise. A dropped connection is
resumed with ``Last-Event-ID``, so nothing is shown twice or missed. ``--json`` prints each
event as one JSON line instead. The exit code says how the job ended (0 succeeded, 6 failed,
7 cancelled), so ``pipette submit job.yaml --watch && ...`` chains like ``gh run watch``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from http.client import HTTPException
from typing import Any, TextIO

from cli import client_output as out
from cli.client_api import (
    EXIT_JOB_CANCELLED,
    EXIT_JOB_FAILED,
    EXIT_OK,
    EXIT_UNREACHABLE,
    ApiError,
    Client,
    client,
    resolve_job,
)

FINAL = {"succeeded": EXIT_OK, "failed": EXIT_JOB_FAILED, "cancelled": EXIT_JOB_CANCELLED}
RECONNECTS = 8


def cmd_watch(args: argparse.Namespace) -> int:
    api = client()
    return watch(api, resolve_job(api, args.job), as_json=args.json)


def watch(api: Client, job_id: str, *, as_json: bool = False, stream: TextIO | None = None) -> int:
    stream = stream or sys.stdout
    job = api.get(f"/v1/jobs/{job_id}")
    view = JsonView(stream) if as_json else WatchView(job, stream)
    view.start()
    if job.get("notice"):
        view.note(f"the job is queued: {job['notice']}")
    last: int | None = None
    failures = 0
    while True:
        try:
            for event in api.events(f"/v1/jobs/{job_id}/events", last):
                last = int(event["id"])
                failures = 0
                view.handle(event)
            job = api.get(f"/v1/jobs/{job_id}")
            if job["state"] in FINAL:
                break
            # The service closed the stream before the end (it is restarting): try again.
            if failures >= RECONNECTS:
                view.close()
                raise ApiError("the event stream kept closing before the job ended", field="PIPETTE_URL",
                               exit_code=EXIT_UNREACHABLE, fix="check the service; `pipette status JOB` shows the job")
            failures += 1
        except BrokenPipeError:  # the reader went away (`| head`): not a connection to retry
            raise
        except ApiError as e:
            if e.exit_code != EXIT_UNREACHABLE or failures >= RECONNECTS:
                view.close()
                raise
            failures += 1
        except (TimeoutError, OSError, HTTPException, json.JSONDecodeError):
            if failures >= RECONNECTS:
                view.close()
                raise ApiError("the event stream kept breaking", field="PIPETTE_URL", exit_code=EXIT_UNREACHABLE,
                               fix="check the service; `pipette status JOB` shows where the job is") from None
            failures += 1
        view.note(f"connection lost; reconnecting ({failures}/{RECONNECTS})")
        time.sleep(min(2.0 * failures, 10.0))
    view.finish(job)
    return FINAL[job["state"]]


class JsonView:
    """One JSON object per event, flushed at once (for scripts and ``jq``)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def start(self) -> None:
        pass

    def handle(self, event: dict[str, Any]) -> None:
        self.stream.write(json.dumps(event, separators=(",", ":")) + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        print(f"pipette: {text}", file=sys.stderr)

    def finish(self, job: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class WatchView:
    """What a person sees: one line per event that matters, and a live progress line."""

    def __init__(self, job: dict[str, Any], stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.job_id = job["id"]
        self.state = job["state"]
        self.max_trials = int(job["budget"].get("max_trials") or job["progress"].get("max_trials") or 1)
        self.model = job["model"].get("name", "?")
        self.method = job["training"].get("method", "")
        self.ended: set[int] = set()
        self.best: dict[str, Any] | None = None
        self.running: int | None = None
        self.step: str = ""
        self.status_shown = False

    # ---- output -----------------------------------------------------------------------
    def _line(self, text: str) -> None:
        self._clear_status()
        self.stream.write(text + "\n")
        self._draw_status()
        self.stream.flush()

    def _progress(self) -> str:
        done = len(self.ended)
        text = f"{out.bar(done, self.max_trials)} {done}/{self.max_trials} trials"
        if self.best:
            text += (f"  best {out.rate(self.best['tokens_per_s'])} tok/s "
                     f"({out.seconds(self.best['step_time'])}/step, trial {self.best['number']})")
        if self.running is not None:
            text += f"  running trial {self.running}" + (f" {self.step}" if self.step else "")
        return text

    def _clear_status(self) -> None:
        if self.tty and self.status_shown:
            self.stream.write("\r\033[K")
            self.status_shown = False

    def _draw_status(self) -> None:
        if self.tty and self.state not in FINAL:
            self.stream.write(out.dim(self._progress(), self.stream))
            self.status_shown = True

    # ---- events -----------------------------------------------------------------------
    def start(self) -> None:
        self._line(f"watching job {out.bold(self.job_id, self.stream)} ({self.model} {self.method}), "
                   f"{self.max_trials} trials at most; Ctrl-C stops watching, not the job")

    def note(self, text: str) -> None:
        self._line(out.dim(text, self.stream))

    def close(self) -> None:
        self._clear_status()
        self.stream.flush()

    def handle(self, event: dict[str, Any]) -> None:
        kind, data, number = event["kind"], event.get("data") or {}, event.get("trial")
        stamp = out.dim(_clock(event.get("at")), self.stream)
        if kind == "state":
            self.state = data.get("state", self.state)
            self._line(f"{stamp} job {out.state(self.state, self.stream)}")
        elif kind == "trial_started":
            self.running, self.step = number, ""
            attempt = f", attempt {data['attempt']}" if int(data.get("attempt", 1)) > 1 else ""
            self._line(f"{stamp} trial {number:<3} {data.get('label', '')}  started "
                       f"(predicted {out.seconds(data.get('predicted_step_time'))}/step{attempt})")
        elif kind == "trial_step":
            warm = " warm-up" if data.get("warmup") else ""
            self.step = f"step {data.get('step')}{warm}: {out.seconds(data.get('time'))}"
            if self.tty:
                self._clear_status()
                self._draw_status()
                self.stream.flush()
        elif kind == "trial_ended":
            self._trial_ended(stamp, number, data)
        elif kind == "trial_interrupted":
            self.running = None
            self._line(f"{stamp} trial {number} interrupted ({data.get('reason', '')}); it will run again")
        elif kind == "cancel_requested":
            self._line(f"{stamp} cancel requested; the running trial stops within a step")
        elif kind == "resumed":
            self._line(f"{stamp} job resumed (attempt {data.get('attempt')}; rerunning "
                       f"{data.get('interrupted_trials') or 'no'} interrupted trials)")
        elif kind == "waiting_for_nodes":
            self._line(f"{stamp} waiting for lost Ray node(s): {', '.join(data.get('missing') or [])} "
                       f"(the job fails after {out.seconds(data.get('limit_s'))} without them)")
        elif kind == "nodes_back":
            self._line(f"{stamp} lost node(s) back after {out.seconds(data.get('waited_s'))}; the job goes on")
        elif kind == "stopped":
            self.running = None
            self._line(f"{stamp} search stopped: {data.get('reason')}")
        elif kind == "finished":
            self.state = data.get("state", self.state)
        else:
            self._line(f"{stamp} {kind} {json.dumps(data)[:200]}")

    def _trial_ended(self, stamp: str, number: int | None, data: dict[str, Any]) -> None:
        from pipette.errors import PipetteError
        from pipette.retry import LOST_NODE_RETRIES
        from pipette.trials import TrialRecord

        self.running, self.step = None, ""
        try:
            record = TrialRecord.from_dict(data)
        except PipetteError as e:  # a service of another version: say so, and go on watching
            self._line(f"{stamp} trial {number} ended; its record is not one this client reads ({e.message})")
            return
        m = record.measurement
        status = m.status
        # An attempt that lost a node is rerun (same number) a few times: not done yet. A retry of a
        # crash is a later trial of its own (pipette.retry), so the crash's trial is done.
        retried = status in ("failed", "timeout") and bool(m.lost_nodes) and record.attempt <= LOST_NODE_RETRIES
        if number is not None and not retried:
            self.ended.add(int(number))
        text = f"{stamp} trial {number:<3} {record.label}  {out.state(f'{status:<7}', self.stream)}"
        step_time, predicted = m.step_time, record.predicted_step_time
        if step_time:
            text += f" {out.seconds(step_time)}/step  {out.rate(m.tokens_per_s)} tok/s"
            if predicted:
                text += f"  (predicted {out.seconds(predicted)}, {(step_time - predicted) / predicted:+.0%})"
        if m.peak_memory_max is not None:
            text += f"  peak {out.size(m.peak_memory_max)}"
        if status == "ok" and step_time and (self.best is None or step_time < self.best["step_time"]):
            self.best = {"number": number, "step_time": step_time, "tokens_per_s": m.tokens_per_s,
                         "label": record.label}
            text += "  " + out.paint("* best so far", "32", self.stream)
        if status != "ok" and m.error:
            text += f"\n      {m.error.splitlines()[0][:160]}"
        self._line(text)
        if not self.tty:
            self._line(f"         {self._progress()}")

    def finish(self, job: dict[str, Any]) -> None:
        self.state = job["state"]
        self._clear_status()
        p = job["progress"]
        self.stream.write(f"\njob {job['id']} {out.state(job['state'], self.stream)} after {p['trials_done']} "
                          f"trials ({p['trials_ok']} ok)" + (f": {job['stop_reason']}" if job.get("stop_reason")
                                                              else "") + "\n")
        best = job.get("best")
        if best:
            self.stream.write(f"best: trial {best['trial']} {out.bold(best['label'], self.stream)}  "
                              f"{out.seconds(best.get('measured_step_time'))}/step  "
                              f"{out.rate(best.get('tokens_per_s'))} tokens/s\n")
            self.stream.write(f"files: pipette best {out.short_id(job['id'])} -o best/\n")
        err = job.get("error")
        if err:
            fix = f" (fix: {err['fix']})" if err.get("fix") else ""
            self.stream.write(f"error: {err['message']}{fix}\n")
        self.stream.flush()


def _clock(at: str | None) -> str:
    when = out.parse_time(at)
    return when.astimezone().strftime("%H:%M:%S") if when else "--:--:--"
