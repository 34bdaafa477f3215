"""The rules that keep cached polled reads correct (``service.changes``), without a database."""

from __future__ import annotations

from service.changes import ChangeFeed, ReadCache


def live_feed() -> ChangeFeed:
    feed = ChangeFeed(None)
    feed._go_live()  # as the listening thread does once LISTEN is in place
    return feed


def test_nothing_is_kept_while_the_feed_does_not_listen() -> None:
    feed = ChangeFeed(None)
    cache = ReadCache(feed)
    assert feed.stamp(["job:a"]) is None
    cache.put("k", feed.stamp(["job:a"]), b"answer")
    assert cache.get("k") is None


def test_an_answer_lives_until_a_notification_names_one_of_its_keys() -> None:
    feed, keys = live_feed(), ["tenant:acme", "clusters:acme"]
    cache = ReadCache(feed)
    cache.put("list", feed.stamp(keys), b"v1")
    feed.changed("trials 1234")  # another job's trials, another tenant's job: not this answer's rows
    feed.changed("job 99 other-tenant")
    assert cache.get("list") == b"v1"
    feed.changed("job 42 acme")  # a job of the tenant
    assert cache.get("list") is None


def test_a_change_during_the_query_leaves_the_stored_answer_stale() -> None:
    """The stamp is taken before the query: a notification that lands while the query runs
    makes the answer it stores stale at once (it may hold the old row)."""
    feed = live_feed()
    cache = ReadCache(feed)
    stamp = feed.stamp(["job:7", "leases"])
    feed.changed("job 7 acme")  # committed while the query ran
    cache.put("job", stamp, b"maybe the old row")
    assert cache.get("job") is None


def test_a_lease_change_reaches_only_answers_that_read_a_lease() -> None:
    feed = live_feed()
    cache = ReadCache(feed)
    queued = feed.stamp(["job:1", "leases"])
    running = feed.stamp(["job:2", "leases"])
    assert queued is not None and running is not None
    cache.put("queued", queued, b"q")
    cache.put("running", running.only(1), b"r")  # a running job's answer does not read the lease
    feed.changed("lease local:host")
    assert cache.get("queued") is None and cache.get("running") == b"r"


def test_a_flush_a_lost_connection_or_an_unknown_payload_drops_everything() -> None:
    for drop in ("flush", "dark", "payload"):
        feed = live_feed()
        cache = ReadCache(feed)
        cache.put("k", feed.stamp(["job:1"]), b"v")
        if drop == "flush":
            feed.flush()  # a write of this process committed
        elif drop == "dark":
            feed._go_dark()
            feed._go_live()  # listening again: what changed meanwhile was not heard
        else:
            feed.changed("something new")
        assert cache.get("k") is None, drop


def test_forgetting_generations_past_the_bound_drops_every_answer() -> None:
    feed = ChangeFeed(None, max_keys=4)
    feed._go_live()
    cache = ReadCache(feed)
    cache.put("k", feed.stamp(["job:1"]), b"v")
    for n in range(5):  # other jobs' changes fill the table; job:1's generation is forgotten
        feed.changed(f"trials {n}")
    assert cache.get("k") is None
