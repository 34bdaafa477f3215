"""Serialized answers of the polled reads, kept per process and keyed by the row they are made of.

A job's (or a trial's) JSON in an answer is a pure function of its row: the hot reads select
the row's columns with the JSON ones as their text (no decoding), look the whole row up here,
and build, validate and serialize the answer only when that exact row was not seen before.
The key is the row itself, so no write can leave a stale answer behind (any change of any
column the answer shows is a new key; there is no ``updated_at`` to forget to bump), and
no tenant can get another's answer (the key holds the row's tenant or job, and the rows are
selected for the caller's tenant first). Answers that depend on something besides the row
(a queued job's notice: the lease and the clock) are added per request.

Without it, most of ``GET /v1/jobs?limit=20``'s CPU was ORM row loading, ``json.loads`` of the
JSON columns and building and validating ``JobOut``; a hit costs a tuple hash and a dict lookup
(profiles and load runs: docs/results.md, "The service under load").
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class AnswerCache(Generic[T]):
    """Up to ``size`` answers by row; full, it starts over (the polled rows come back at once)."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._answers: dict[Hashable, T] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, row: Hashable, build: Callable[[], T]) -> T:
        """The answer made of ``row`` (``build()`` it when this row was not seen)."""
        with self._lock:
            found = self._answers.get(row)
        if found is not None:
            self.hits += 1
            return found
        self.misses += 1
        answer = build()
        with self._lock:
            if len(self._answers) >= self.size:
                self._answers.clear()
            self._answers[row] = answer
        return answer
