"""``GET /v1/jobs/{id}/events``: the job's live event stream as server-sent events.

Each event is one stored ``Event`` row; its id is the SSE ``id``, so a client that reconnects
with ``Last-Event-ID`` (browsers do it themselves) gets exactly what it missed. Events are
read from the database, so the stream works whichever process runs the job. The stream ends
after the job's final state has been sent (or at once with ``follow=false``), after
``stream_idle_s`` without an event, or within seconds of its token being revoked. Open streams
are capped per tenant and in all (``service.streams``: 429 with Retry-After).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Annotated

from fastapi import APIRouter, Header, Path, Query, Request
from fastapi.responses import StreamingResponse
from sqlalchemy.exc import SQLAlchemyError
from starlette.concurrency import run_in_threadpool

from service.auth import bearer_secret
from service.deps import AppState, Caller, State, authenticate
from service.errors import AuthError, RequestError
from service.models import FINAL_STATES, Event, Job
from service.outage import OUTAGE, is_unavailable
from service.repositories import events as repo
from service.repositories.jobs import get_job
from service.routes import AUTHED, json_errors
from service.schemas import ID_PATTERN
from service.streams import SlotStreamingResponse

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

POLL_S = 0.25
#: the longest wait between two polls of a quiet job
MAX_POLL_S = 1.0
#: how often an open stream checks that its token is still valid (seconds)
TOKEN_CHECK_S = 2.0
KEEPALIVE_S = 15.0
RETRY_MS = 2000
#: the largest event id a client may resume after, ``?after`` and ``Last-Event-ID`` alike: a
#: larger one overflows the database's 64-bit integer once the stream has started
MAX_EVENT_ID = 2**62


@router.get("/{job_id}/events", response_class=StreamingResponse, responses={
    200: {"content": {"text/event-stream": {"schema": {"type": "string"}}},
          "description": "Server-sent events: `id` (resume with Last-Event-ID), `event` (the kind), `data` (JSON)"},
    **json_errors(*AUTHED, 404, 429),
})
async def stream_events(
    request: Request,
    state: State,
    caller: Caller,
    job_id: Annotated[str, Path(max_length=36, pattern=ID_PATTERN)],
    last_event_id: Annotated[str, Header(alias="Last-Event-ID", max_length=20, pattern=r"^[0-9]*$",
                                         description="resume after this event id (what EventSource sends)")] = "",
    after: Annotated[int, Query(ge=0, le=MAX_EVENT_ID, description="start after this event id")] = 0,
    follow: Annotated[bool, Query(description="keep the stream open until the job ends")] = True,
) -> StreamingResponse:
    start = _resume_point(last_event_id, after)
    secret = bearer_secret(request)
    await run_in_threadpool(_check_job, state, caller.tenant, job_id)
    give_back = state.streams.take(caller.tenant)
    return SlotStreamingResponse(_event_lines(request, state, job_id, start, follow, secret), give_back=give_back,
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _check_job(state: AppState, tenant: str, job_id: str) -> None:
    """The job is the tenant's, else a 404 (as a missing one), before a stream's slot is taken."""
    with state.db.read() as session:
        get_job(session, tenant, job_id)


def _fetch_events(state: AppState, job_id: str, last: int) -> tuple[Sequence[Event], bool]:
    """The job's events after ``last``, and whether the job has reached a final state."""
    with state.db.read() as session:
        # The state first: a final state's own event is committed with it, so it is in rows.
        job = session.get(Job, job_id)
        final = job is None or job.state in FINAL_STATES
        return repo.events_after(session, job_id, last), final


async def _still_allowed(state: AppState, secret: str) -> bool:
    try:
        await authenticate(state, secret)
    except AuthError:
        return False  # revoked: its streams end too, not only its next request
    return True


async def _event_lines(request: Request, state: AppState, job_id: str, start: int, follow: bool,
                       secret: str) -> AsyncIterator[str]:
    """The stream's text: each event after ``start`` as it is stored, keep-alives while the job is
    quiet, until the job ends (or at once without ``follow``), the stream idles, the token is
    revoked, the service stops or the client leaves."""
    last = start
    yield f"retry: {RETRY_MS}\n\n"
    now = time.monotonic()
    quiet_since = event_at = checked_at = now
    wait = POLL_S
    while True:
        try:
            rows, final = await run_in_threadpool(_fetch_events, state, job_id, last)
        except SQLAlchemyError as e:
            if not is_unavailable(e):
                raise
            OUTAGE.failed(e, "an event stream")
            return  # the client reconnects after RETRY_MS with Last-Event-ID
        for event in rows:
            last = event.id
            yield format_event(event)
        now = time.monotonic()
        if now - checked_at > TOKEN_CHECK_S:  # a busy stream too: it delivered events after a revocation
            if not await _still_allowed(state, secret):
                return
            checked_at = now
        if rows:
            quiet_since = event_at = now
            wait = POLL_S
            continue
        if final or not follow or state.stopping.is_set() or await request.is_disconnected():
            return
        if now - event_at > state.settings.stream_idle_s:
            return  # idle: the client reconnects with Last-Event-ID if it still reads
        if now - quiet_since > KEEPALIVE_S:
            yield ": keep-alive\n\n"
            quiet_since = now
        await asyncio.sleep(wait)
        wait = min(wait * 2, MAX_POLL_S)  # a quiet job is polled less often


def format_event(event: Event) -> str:
    data = {"id": event.id, "job_id": event.job_id, "kind": event.kind, "trial": event.trial,
            "data": event.data, "at": event.created_at.isoformat()}
    return f"id: {event.id}\nevent: {event.kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def _resume_point(last_event_id: str, after: int) -> int:
    if not last_event_id:
        return after
    try:
        value = int(last_event_id)
    except ValueError:
        raise RequestError(f"is {last_event_id!r}, not an event id", field="Last-Event-ID",
                           fix="send the id of the last event received (a whole number)") from None
    if value < 0:
        raise RequestError("is negative", field="Last-Event-ID", fix="send the id of the last event received")
    if value > MAX_EVENT_ID:
        raise RequestError(f"is {value}, above the largest event id", field="Last-Event-ID",
                           fix=f"give a value at most {MAX_EVENT_ID} (the id of the last event received)")
    return value
