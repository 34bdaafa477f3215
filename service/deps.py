"""What routes receive: the app's database and settings, and the caller (every route but
health depends on ``principal``, which authenticates the Bearer token)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from service.auth import PRINCIPAL_KEY, Principal, TokenCache, bearer_secret, verify
from service.changes import ChangeFeed, ReadCache
from service.db import Database
from service.errors import RequestError
from service.metrics import Metrics
from service.rates import TenantRate
from service.settings import Settings
from service.streams import StreamSlots
from service.views import Answers

if TYPE_CHECKING:
    from service.scheduler import Scheduler


@dataclass
class AppState:
    settings: Settings
    db: Database
    metrics: Metrics
    scheduler: Scheduler | None = None
    tokens: TokenCache = field(default_factory=TokenCache)
    streams: StreamSlots = field(default_factory=lambda: StreamSlots(20, 200))
    plans: TenantRate = field(default_factory=lambda: TenantRate(60, "PIPETTE_PLANS_PER_MINUTE", "plans"))
    #: the polled reads' answers, by the rows they are made of
    answers: Answers = field(default_factory=Answers)
    #: the polled reads' answers by request, kept until PostgreSQL notifies a change of their rows
    feed: ChangeFeed = field(default_factory=ChangeFeed)
    reads: ReadCache = field(init=False)
    #: set when the process was told to stop (SIGTERM): event streams end, the scheduler stops
    stopping: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.reads = ReadCache(self.feed)

    def begin_shutdown(self) -> None:
        """The process is stopping: take no more work (the running trial is interrupted) and
        end the event streams, so open watchers do not hold the shutdown (issue 17 item 22:
        with a watcher, the scheduler started the next trial after the SIGTERM)."""
        self.stopping.set()
        if self.scheduler is not None:
            self.scheduler.request_stop()

    def kick(self) -> None:
        """Wake this process's scheduler (new work); other processes find it by polling."""
        if self.scheduler is not None:
            self.scheduler.kick()


async def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.pipette
    return state


#: Declares the Bearer scheme in the OpenAPI schema; the header is checked in ``principal``
#: (so a missing and a malformed header get their own message).
_BEARER = HTTPBearer(auto_error=False, description="a token from `pipette-admin token create --tenant NAME`")


async def principal(
    request: Request,
    state: Annotated[AppState, Depends(app_state)],
    _declared: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
) -> Principal:
    # Dependencies are async so the cheap path (a cached token) costs no thread hop; the
    # database lookup runs in the thread pool like every sync route. A request with a body was
    # authenticated before it was read (``service.gate``).
    found: Principal | None = request.scope.get(PRINCIPAL_KEY)
    return found if found is not None else await authenticate(state, bearer_secret(request))


async def authenticate(state: AppState, secret: str) -> Principal:
    """The token's principal (AuthError when it is unknown or revoked), cached ``token_cache_s``."""
    cached = state.tokens.get(secret)
    if cached is not None:
        return cached

    def lookup() -> Principal:
        with state.db.read() as session:
            return verify(session, secret)

    found = await run_in_threadpool(lookup)
    state.tokens.put(secret, found)
    return found


State = Annotated[AppState, Depends(app_state)]
Caller = Annotated[Principal, Depends(principal)]


async def reject_unknown_query(request: Request) -> None:
    """A query parameter the route does not take is an error (a typo such as ``?stat=running``
    would otherwise be ignored and answer as if no filter had been asked for)."""
    if not request.scope.get("query_string"):
        return
    route = request.scope.get("route")
    if getattr(route, "dependant", None) is None:
        return
    known = _route_query_names(route)
    for name in request.query_params:
        if name not in known:
            raise RequestError(f"unknown query parameter {name!r}", field=name or "query",
                               fix=f"use only {', '.join(sorted(known))}" if known else "send no query parameters")


def _route_query_names(route: Any) -> frozenset[str]:
    """The query parameters a route takes, worked out once per route (kept on the route
    object), not per request."""
    known: frozenset[str] | None = getattr(route, "_pipette_query_names", None)
    if known is None:
        known = frozenset(_query_names(route.dependant))
        route._pipette_query_names = known
    return known


def _query_names(dependant: Any) -> set[str]:
    names = {p.alias for p in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_names(sub)
    return names
