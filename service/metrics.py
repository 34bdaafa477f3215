"""Prometheus metrics: jobs by state, trials run, trial durations, API latency.

Jobs and trials are counted from the database at scrape time, so the figures are the same
whichever process (the API's scheduler thread or ``python -m service.worker``) ran them, and
survive restarts. API latency is measured in this process, per route template.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.db import Database
from service.models import JOB_STATES, TRIAL_STATES
from service.repositories import jobs, trials

#: Trial durations (seconds) from a few seconds on CPU to an hour on a large cluster.
TRIAL_BUCKETS = (1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800, 3600)
API_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class DatabaseCollector(Collector):
    def __init__(self, db: Database) -> None:
        self.db = db

    def collect(self) -> Iterator[Metric]:
        with self.db.read() as session:
            job_counts = jobs.counts_by_state(session)
            trial_counts = trials.counts_by_state(session)
            durations = trials.durations(session)
        gauge = GaugeMetricFamily("pipette_jobs", "Jobs by state", labels=["state"])
        for state in JOB_STATES:
            gauge.add_metric([state], job_counts.get(state, 0))
        yield gauge
        counter = CounterMetricFamily("pipette_trials", "Trials run, by outcome", labels=["state"])
        for state in TRIAL_STATES:
            counter.add_metric([state], trial_counts.get(state, 0))
        yield counter
        yield _histogram("pipette_trial_duration_seconds", "Wall time of ended trials", durations, TRIAL_BUCKETS)


def _histogram(name: str, doc: str, values: list[float], bounds: tuple[float, ...]) -> HistogramMetricFamily:
    buckets: list[tuple[str, float]] = []
    for bound in bounds:
        buckets.append((str(float(bound)), float(sum(1 for v in values if v <= bound))))
    buckets.append(("+Inf", float(len(values))))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=float(sum(values)))


class Metrics:
    """One registry per app (tests build many apps in one process)."""

    def __init__(self, db: Database) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(DatabaseCollector(db))
        self.api_latency = Histogram(
            "pipette_api_request_duration_seconds", "API latency by route template, method and status",
            ["method", "route", "status"], buckets=API_BUCKETS, registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class LatencyMiddleware:
    """Times every HTTP request; labels by the matched route's template (bounded cardinality)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route: Any = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            self.metrics.api_latency.labels(scope["method"], template, str(status["code"])).observe(
                time.perf_counter() - start
            )
