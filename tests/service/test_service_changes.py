"""Polled reads answered from memory until PostgreSQL notifies a change (``service.changes``):
a write by another process (its own engine, a Core ``UPDATE``) shows in the next reads within
the notification's delivery; without the ``0005`` triggers, or while the feed is not
listening, every read goes to the database."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, event, text, update
from sqlalchemy.orm import Session

from service.migrations import upgrade
from service.models import Job
from service.repositories.trials import start_trial
from tests.service.conftest import Api, make_api, throwaway_pg_database


def _counting(api: Api) -> tuple[list[str], Callable[[], None]]:
    statements: list[str] = []

    def count(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "FROM tokens" not in statement:
            statements.append(statement)

    event.listen(api.db.engine, "before_cursor_execute", count)
    return statements, lambda: event.remove(api.db.engine, "before_cursor_execute", count)


def _wait_live(api: Api) -> None:
    feed = api.client.app.state.pipette.feed  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while not feed.live:
        assert time.monotonic() < deadline, "the change feed did not start listening"
        time.sleep(0.05)


@pytest.mark.parametrize("api", ["postgresql"], indirect=True)
def test_another_processs_write_shows_in_the_next_reads(api: Api, job_body: Callable[..., dict[str, Any]]) -> None:
    headers = api.token("changes-a")
    api.local_cluster(headers)
    job_id = api.client.post("/v1/jobs", json=job_body(), headers=headers).json()["id"]
    _wait_live(api)
    paths = ("/v1/jobs", f"/v1/jobs/{job_id}", f"/v1/jobs/{job_id}/trials")
    first = [api.client.get(p, headers=headers).json() for p in paths]
    statements, stop = _counting(api)
    try:
        # nothing changed: answered from memory, once the submit's own notification has come (on
        # a loaded 2-core machine it came after the first reads: issue 43, item 23)
        deadline = time.monotonic() + 20.0
        while True:
            statements.clear()
            again = [api.client.get(p, headers=headers).json() for p in paths]
            if statements == [] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert again == first
        assert statements == [], statements
        other = create_engine(api.db.url)  # another process's writes: no hook of this one sees them
        try:
            with Session(other) as session, session.begin():
                session.execute(update(Job).where(Job.id == job_id).values(progress={"trials_done": 5}, attempts=2))
                start_trial(session, job_id, 0, label="tp1-pp1-dp2", config={"tp": 1}, predicted_step_time=1.0)
        finally:
            other.dispose()
        # PostgreSQL notifies at once; the feed's thread may wait for a core on a loaded 2-core
        # machine (issue 43, item 23: this failed there at 2 s, passing 6 of 6 alone)
        deadline = time.monotonic() + 20.0
        while True:
            seen = [api.client.get(p, headers=headers).json() for p in paths]
            # the notification may land between two of these reads: wait until all three show it
            listed, one, trials = seen
            if listed["items"][0]["attempts"] == 2 and one["progress"].get("trials_done") == 5 and trials["items"]:
                break
            assert time.monotonic() < deadline, f"the write did not show within 20 s: {seen[1]['progress']}"
            time.sleep(0.01)
        assert seen[0]["items"][0]["attempts"] == 2 and seen[2]["items"][0]["label"] == "tp1-pp1-dp2"
    finally:
        stop()


def test_without_the_triggers_or_the_feed_every_read_queries(tmp_path: Path,
                                                            job_body: Callable[..., dict[str, Any]],
                                                            caplog: pytest.LogCaptureFixture) -> None:
    with throwaway_pg_database("pipette_nofeed") as url:
        upgrade(url)
        # the schema this code reads, without 0005's change triggers (as 0005's downgrade leaves
        # it): no notifications come
        engine = create_engine(url)
        with engine.begin() as connection:
            connection.execute(text("DROP FUNCTION pipette_notify_change() CASCADE"))
        engine.dispose()
        for api in make_api(url, "postgresql", tmp_path):
            headers = api.token("changes-b")
            api.local_cluster(headers)
            job_id = api.client.post("/v1/jobs", json=job_body(), headers=headers).json()["id"]
            time.sleep(0.5)  # the feed has looked for the triggers
            feed = api.client.app.state.pipette.feed  # type: ignore[attr-defined]
            assert not feed.live
            assert any("change triggers" in r.getMessage() and "pipette-admin migrate" in r.getMessage()
                       for r in caplog.records)
            statements, stop = _counting(api)
            try:
                for _ in range(2):
                    statements.clear()
                    assert api.client.get(f"/v1/jobs/{job_id}", headers=headers).status_code == 200
                    assert len(statements) == 1, statements
            finally:
                stop()
            feed.stop()


@pytest.mark.parametrize("api", ["postgresql"], indirect=True)
def test_a_feed_that_stops_listening_sends_every_read_to_the_database(
        api: Api, job_body: Callable[..., dict[str, Any]]) -> None:
    headers = api.token("changes-c")
    api.local_cluster(headers)
    job_id = api.client.post("/v1/jobs", json=job_body(), headers=headers).json()["id"]
    _wait_live(api)
    api.client.get(f"/v1/jobs/{job_id}", headers=headers)
    statements, stop = _counting(api)
    try:
        # the submit's own notification may still be on its way (a loaded machine): the read is
        # answered from memory once it has come
        deadline = time.monotonic() + 20.0
        while True:
            statements.clear()
            api.client.get(f"/v1/jobs/{job_id}", headers=headers)
            if statements == [] or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert statements == []
        api.client.app.state.pipette.feed.stop()  # type: ignore[attr-defined]  # as when its connection drops
        api.client.get(f"/v1/jobs/{job_id}", headers=headers)
        assert len(statements) == 1, statements
    finally:
        stop()


def test_a_feed_that_stops_hearing_its_own_pings_goes_dark_and_comes_back() -> None:
    """A connection that LISTENs but hears nothing (a transaction-pooling PgBouncer gives the
    LISTEN and the writes' NOTIFY different server connections) must not keep answers forever:
    the feed notifies itself every ``ping_s`` and goes dark when a ping does not come back."""
    from service.changes import ChangeFeed

    with throwaway_pg_database("pipette_ping") as url:
        upgrade(url)
        feed = ChangeFeed(url, ping_s=0.2, ping_timeout_s=0.6)
        feed.start()
        try:
            _until(lambda: feed.live, "the feed did not start listening")
            time.sleep(1.0)  # several pings come back: still live
            assert feed.live
            feed.ping_channel = "pipette_nowhere"  # its pings are no longer heard
            _until(lambda: not feed.live, "the feed stayed live without hearing its pings")
            feed.ping_channel = "pipette_changes"
            _until(lambda: feed.live, "the feed did not come back", seconds=10)
        finally:
            feed.stop()


def _until(check: Callable[[], bool], message: str, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)
