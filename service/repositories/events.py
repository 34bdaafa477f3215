"""A job's event stream: appended by the scheduler, read by the SSE route from any process."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.models import Event, utcnow


def add_event(session: Session, job_id: str, kind: str, data: dict[str, Any], trial: int | None = None) -> Event:
    event = Event(job_id=job_id, kind=kind, trial=trial, data=data, created_at=utcnow())
    session.add(event)
    return event


def events_after(session: Session, job_id: str, after: int, limit: int = 500) -> Sequence[Event]:
    return session.execute(
        select(Event).where(Event.job_id == job_id, Event.id > after).order_by(Event.id).limit(limit)
    ).scalars().all()
