"""``pipette-admin`` (``python -m service.admin``): the operator's commands.

    pipette-admin migrate [REVISION]            upgrade the database (default: head)
    pipette-admin downgrade REVISION            e.g. base
    pipette-admin token create --tenant NAME    print a new API token (shown once)
    pipette-admin token list [--tenant NAME]
    pipette-admin token revoke ID
    pipette-admin cluster allow-scripts --tenant NAME --cluster NAME [--off]
                                                let that tenant's jobs on that cluster run their own script
    pipette-admin serve [--host H] [--port P]   the API (and its scheduler thread)
    pipette-admin worker                        a scheduler process without the API

The database is ``PIPETTE_DATABASE_URL`` (default: SQLite under ``PIPETTE_HOME``). Exit codes:
0 success, 1 an error (one line naming what and the fix), 2 a bad command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from types import FrameType

from sqlalchemy import select
from sqlalchemy.exc import OperationalError, ProgrammingError, SQLAlchemyError

from pipette.errors import PipetteError
from service.settings import Settings


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        settings = Settings.from_env()
        code: int = args.func(args, settings)
        return code
    except PipetteError as e:
        print(f"pipette-admin: error: {e}", file=sys.stderr)
        return 1
    except (OperationalError, ProgrammingError) as e:
        first = str(e.orig).splitlines()[0] if e.orig else str(e).splitlines()[0]
        print(f"pipette-admin: error: database: {first} (fix: check PIPETTE_DATABASE_URL and run "
              "`pipette-admin migrate`)", file=sys.stderr)
        return 1
    except SQLAlchemyError as e:
        print(f"pipette-admin: error: database: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pipette-admin", description="Operate Pipette's service.")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    migrate = sub.add_parser("migrate", help="upgrade the database schema (never done at app start)")
    migrate.add_argument("revision", nargs="?", default="head")
    migrate.set_defaults(func=_migrate)
    down = sub.add_parser("downgrade", help="downgrade the database schema (e.g. to base)")
    down.add_argument("revision")
    down.set_defaults(func=_downgrade)

    token = sub.add_parser("token", help="API tokens").add_subparsers(title="token commands", metavar="ACTION")
    create = token.add_parser("create", help="create a token for a tenant and print it (once)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--name", default="", help="a label for the token")
    create.add_argument("--json", action="store_true")
    create.set_defaults(func=_token_create)
    listing = token.add_parser("list", help="list tokens (never their secrets)")
    listing.add_argument("--tenant")
    listing.set_defaults(func=_token_list)
    revoke = token.add_parser("revoke", help="revoke a token by id")
    revoke.add_argument("id", type=int)
    revoke.set_defaults(func=_token_revoke)

    cluster = sub.add_parser("cluster", help="clusters' permissions").add_subparsers(
        title="cluster commands", metavar="ACTION")
    allow = cluster.add_parser("allow-scripts", help="let a tenant's jobs on a cluster run their own training "
                               "script (its code runs on the cluster's nodes); --off takes it back")
    allow.add_argument("--tenant", required=True)
    allow.add_argument("--cluster", required=True, help="the cluster's name or id")
    allow.add_argument("--off", action="store_true")
    allow.set_defaults(func=_allow_scripts)

    serve = sub.add_parser("serve", help="run the API (with its scheduler unless PIPETTE_SCHEDULER=0)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--no-access-log", action="store_true", help="do not log every request")
    serve.add_argument("--http", choices=("auto", "httptools", "h11"), default="auto",
                       help="HTTP parser (auto and h11: h11 with the service's deadlines and connection caps; "
                            "httptools: the C one, without them, for behind a reverse proxy)")
    serve.add_argument("--loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                       help="event loop (auto: uvloop when installed)")
    serve.add_argument("--workers", type=int, default=1,
                       help="API processes (above 1: with PIPETTE_SCHEDULER=0 and a separate `worker`)")
    serve.set_defaults(func=_serve)
    worker = sub.add_parser("worker", help="run a scheduler without the API")
    worker.set_defaults(func=_worker)
    return parser


def _migrate(args: argparse.Namespace, settings: Settings) -> int:
    from service.migrations import upgrade

    _ensure_home(settings)
    upgrade(settings.database_url, args.revision)
    print(f"database at {args.revision} ({_redacted(settings.database_url)})")
    return 0


def _downgrade(args: argparse.Namespace, settings: Settings) -> int:
    from service.migrations import downgrade

    downgrade(settings.database_url, args.revision)
    print(f"database at {args.revision} ({_redacted(settings.database_url)})")
    return 0


def _token_create(args: argparse.Namespace, settings: Settings) -> int:
    from service.auth import create_token
    from service.db import Database

    db = Database(settings.database_url)
    with db.write() as session:
        token, secret = create_token(session, args.tenant, args.name)
        token_id = token.id
    db.dispose()
    if args.json:
        print(json.dumps({"id": token_id, "tenant": args.tenant, "token": secret}))
    else:
        print(secret)
        print(f"token {token_id} for tenant {args.tenant!r}: shown once, store it now", file=sys.stderr)
    return 0


def _token_list(args: argparse.Namespace, settings: Settings) -> int:
    from service.db import Database
    from service.models import Token

    db = Database(settings.database_url)
    with db.read() as session:
        query = select(Token).order_by(Token.id)
        if args.tenant:
            query = query.where(Token.tenant == args.tenant)
        for t in session.execute(query).scalars():
            state = f"revoked {t.revoked_at.isoformat()}" if t.revoked_at else "active"
            print(f"{t.id}\t{t.tenant}\t{t.prefix}...\t{t.name}\t{t.created_at.isoformat()}\t{state}")
    db.dispose()
    return 0


def _token_revoke(args: argparse.Namespace, settings: Settings) -> int:
    from service.auth import revoke_token
    from service.db import Database

    db = Database(settings.database_url)
    with db.write() as session:
        done = revoke_token(session, args.id)
    db.dispose()
    if not done:
        raise PipetteError(f"no active token {args.id}", field="id", fix="see `pipette-admin token list`")
    print(f"token {args.id} revoked")
    return 0


def _allow_scripts(args: argparse.Namespace, settings: Settings) -> int:
    from service.db import Database
    from service.repositories.clusters import get_cluster

    db = Database(settings.database_url)
    try:
        with db.write() as session:
            cluster = get_cluster(session, args.tenant, args.cluster)
            cluster.allow_scripts = not args.off
            name = cluster.name
    finally:
        db.dispose()
    print(f"scripts {'disabled' if args.off else 'enabled'} for tenant {args.tenant!r} on cluster {name!r}")
    return 0


def _serve(args: argparse.Namespace, settings: Settings) -> int:
    import uvicorn

    from service.app import create_app
    from service.limits import MAX_HEADER_BYTES
    from service.logs import configure as configure_logging
    from service.protocol import ACCEPT_BACKLOG

    configure_logging()  # uvicorn sets up its own loggers only: Pipette's INFO lines were dropped
    _ensure_home(settings)
    if args.workers < 1:
        raise PipetteError(f"is {args.workers}", field="--workers", fix="give 1 or more")
    if args.workers > 1 and settings.scheduler:
        raise PipetteError("several API processes would each run a scheduler and a local Ray",
                           field="--workers", fix="set PIPETTE_SCHEDULER=0 and run `pipette-admin worker` beside them")
    if settings.scheduler:
        # The scheduler needs the database from its first poll: a missing or unmigrated one
        # killed the process with a traceback. Without a scheduler, /readyz says 503 instead.
        check_database(settings)
    # Open event streams must not hold a shutdown forever: they get 10 s, then the scheduler
    # stops (interrupting the running trial, which a restart reruns) and the lease is freed.
    options = {"host": args.host, "port": args.port, "log_level": "info", "timeout_graceful_shutdown": 10,
               "access_log": not args.no_access_log, "http": _protocol(args.http, settings), "loop": args.loop,
               "h11_max_incomplete_event_size": MAX_HEADER_BYTES, "backlog": ACCEPT_BACKLOG}
    if args.workers > 1:
        uvicorn.run("service.app:app_from_env", factory=True, workers=args.workers, **options)
        return 0
    app = create_app(settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            # At the signal, not after the connections drained: the scheduler stops taking
            # work and the event streams end, so a watcher does not keep a trial starting.
            app.state.pipette.begin_shutdown()
            super().handle_exit(sig, frame)

    # uvicorn puts back the handler it found and re-raises the signal after the drain: an ignored
    # SIGINT inherited from a background job (`pipette serve &`) then ended the process 0 with nothing
    # said. As `tune`, a SIGINT sent is an interrupt (130, said) whatever was inherited.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    Server(uvicorn.Config(app, **options)).run()
    return 0


def _protocol(http: str, settings: Settings) -> object:
    """uvicorn's HTTP protocol: h11 (what ``auto`` picks) with ``service.protocol``'s guards: a
    431 for an oversized header block, deadlines for slow clients, connection caps. httptools,
    asked for by name, has none of them: run it behind a reverse proxy that applies them."""
    if http == "httptools":
        logging.getLogger("pipette.service").warning(
            "--http httptools: the slow-client deadlines and connection caps are h11's; put a reverse proxy "
            "that applies them in front (docs/deployment.md)")
        return http
    from service.protocol import connection_limits, guarded_protocol, raise_fd_limit

    raise_fd_limit()
    return guarded_protocol(connection_limits(settings))


def _worker(_args: argparse.Namespace, settings: Settings) -> int:
    from service.scheduler import run_worker

    _ensure_home(settings)
    check_database(settings)
    run_worker(settings)
    return 0


def check_database(settings: Settings) -> None:
    """One line, before anything starts, when the database cannot be reached or is not at the
    schema this code needs."""
    from sqlalchemy.exc import SQLAlchemyError

    from service.db import Database
    from service.migrations import current_revision, head_revision

    where = _redacted(settings.database_url)
    db = Database(settings.database_url)
    try:
        current = current_revision(db.engine)
    except SQLAlchemyError as e:
        first = str(getattr(e, "orig", None) or e).splitlines()[0]
        raise PipetteError(f"cannot reach the database {where}: {first}", field="PIPETTE_DATABASE_URL",
                           fix="start the database (or create it), or point PIPETTE_DATABASE_URL at one") from None
    finally:
        db.dispose()
    head = head_revision()
    if current != head:
        raise PipetteError(f"the database {where} is at schema {current or 'none (empty)'}, this code needs {head}",
                           field="PIPETTE_DATABASE_URL", fix="run `pipette-admin migrate`")


def _ensure_home(settings: Settings) -> None:
    """The service's home (its SQLite database, the jobs' unpacked folders) is its user's alone
    (0700): a tenant's script, run as another user (``workers.host.script_user``), reads none of it."""
    home = settings.home
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    if home.stat().st_uid == os.geteuid():
        home.chmod(0o700)


def _redacted(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
