"""The FastAPI app factory: ``create_app(settings)``.

Nothing here touches the schema: migrations are a command (``pipette-admin migrate``), and
``/readyz`` says when they have not been run. The scheduler thread starts with the app when
``settings.scheduler`` is set (the default), and stops with it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from service import dashboard
from service.apidocs import install_docs
from service.auth import TokenCache
from service.changes import ChangeFeed
from service.db import Database
from service.deps import AppState, reject_unknown_query
from service.errors import install_error_handlers
from service.gate import AuthFirstMiddleware
from service.limits import BodyLimitMiddleware, HeaderLimitMiddleware
from service.metrics import LatencyMiddleware, Metrics
from service.protocol import install_accept_log
from service.rates import TenantRate
from service.routes import clusters, events, jobs, ops, plan
from service.settings import Settings
from service.streams import StreamSlots

DESCRIPTION = """Pipette's service: register clusters, submit tuning jobs, follow their trials live,
download the best configuration's launch files, and plan what-if clusters without trials.

Every endpoint under /v1 and /metrics takes `Authorization: Bearer <token>`
(`pipette-admin token create --tenant NAME`). Errors answer `{"error": {"message", "field", "fix"}}`.
"""


def create_app(settings: Settings | None = None, *, database: Database | None = None) -> FastAPI:
    settings = settings or Settings.from_env()
    db = database or Database(settings.database_url)
    state = AppState(settings=settings, db=db, metrics=Metrics(db), tokens=TokenCache(settings.token_cache_s),
                     streams=StreamSlots(settings.max_streams_per_tenant, settings.max_streams),
                     plans=TenantRate(settings.plans_per_minute, "PIPETTE_PLANS_PER_MINUTE", "plans"),
                     feed=ChangeFeed(db.url if settings.read_cache else None))

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        # Everything loaded so far (the core, SQLAlchemy, pydantic schemas) lives as long as the
        # process: keep it out of the collector's way, so full collections stay short and
        # requests do not stall behind them (CPython's gc.freeze).
        gc.collect()
        gc.freeze()
        install_accept_log(asyncio.get_running_loop())
        db.after_commit.append(state.feed.flush)  # this process's writes: its cached reads go at once
        state.feed.start()
        if settings.scheduler:
            from service.scheduler import Scheduler

            state.scheduler = Scheduler(db, settings)
            state.scheduler.start()
        try:
            yield
        finally:
            state.feed.stop()
            db.after_commit.remove(state.feed.flush)
            if state.scheduler is not None:
                state.scheduler.stop()
                state.scheduler = None
            if database is None:
                db.dispose()

    app = FastAPI(title="Pipette", version="1", description=DESCRIPTION, lifespan=lifespan,
                  dependencies=[Depends(reject_unknown_query)], docs_url=None, redoc_url=None)
    app.state.pipette = state
    install_error_handlers(app)
    for module in (ops, clusters, jobs, events, plan):
        app.include_router(module.router)
    install_docs(app)  # /docs and /redoc without a CDN
    app.include_router(dashboard.router)  # the web dashboard at / (static files)
    app.add_middleware(AuthFirstMiddleware)  # the token before the body is read or parsed
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(LatencyMiddleware, metrics=state.metrics)
    app.add_middleware(HeaderLimitMiddleware)  # outermost: before anything reads the request
    logging.getLogger("pipette.service").setLevel(logging.INFO)
    return app


def app_from_env() -> FastAPI:
    """The app with settings from the environment (uvicorn's factory for several workers)."""
    from service.logs import configure as configure_logging

    configure_logging()  # each worker process is a fresh interpreter
    return create_app(Settings.from_env())
