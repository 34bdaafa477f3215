"""``pipette serve | login | token create | demo``: run the service, log in, make tokens, and the
one-command demo.

``serve`` and ``token create`` run the service's own code (``service.admin``) in this process,
so they need the ``service`` extra and the service's settings (``PIPETTE_HOME``,
``PIPETTE_DATABASE_URL``); everything else in the client needs only the URL and a token.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cli import client_output as out
from cli.client_api import (
    DEFAULT_URL,
    EXIT_AUTH,
    EXIT_ERROR,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_UNREACHABLE,
    ApiError,
    Client,
    Target,
    config_path,
    normalize_url,
    write_config,
)

ROOT = Path(__file__).resolve().parents[2]
DEMO_JOB = ROOT / "examples" / "jobs" / "tiny-cpu.yaml"
#: What the demo submits when the repository's examples are not at hand (an installed wheel).
DEMO_BODY: dict[str, Any] = {
    "name": "demo: tiny-llama LoRA on 2 CPU devices", "cluster": "local", "model": "tiny-llama",
    "training": {"global_batch": 4, "seq_len": 32, "dtype": "fp32", "method": "lora", "lora": {"rank": 8, "alpha": 16}},
    "budget": {"max_trials": 3, "steps": 4},
}


# ---- serve ----------------------------------------------------------------------------

def cmd_serve(args: argparse.Namespace) -> int:
    from service import admin
    from service.settings import Settings

    settings = Settings.from_env()
    if settings.database_url.startswith("sqlite") and not args.no_migrate:
        # The embedded default: a person should not need a second command to get a schema.
        # PostgreSQL is migrated by its operator (`pipette-admin migrate`), never here.
        code = admin.main(["migrate"])
        if code:
            return code
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    print(f"pipette: dashboard and API at http://{host}:{args.port}/ (API reference: /docs); "
          f"a token: pipette token create --tenant NAME --login", file=sys.stderr, flush=True)
    return admin.main(["serve", "--host", args.host, "--port", str(args.port)])


# ---- login ----------------------------------------------------------------------------

def cmd_login(args: argparse.Namespace) -> int:
    saved = Target.resolve()
    url = normalize_url(args.url or os.environ.get("PIPETTE_URL") or saved.url or DEFAULT_URL)
    if args.with_token:
        token = sys.stdin.readline().strip()
    elif os.environ.get("PIPETTE_TOKEN"):
        token = os.environ["PIPETTE_TOKEN"].strip()
    elif sys.stdin.isatty():
        token = getpass.getpass(f"token for {url} (from `pipette token create`): ").strip()
    else:
        raise ApiError("no token given", field="token", exit_code=EXIT_AUTH,
                       fix="pipe it in: `echo $TOKEN | pipette login --with-token`, or set PIPETTE_TOKEN")
    if not token:
        raise ApiError("the token is empty", field="token", exit_code=EXIT_AUTH,
                       fix="give the token `pipette token create --tenant NAME` printed")
    Client(Target(url, token, "the token given")).get("/v1/clusters")  # raises on a refused token
    path = config_path()
    write_config(path, url, token)
    print(f"logged in to {url}; saved to {path} (readable by you only)")
    return EXIT_OK


# ---- token create ---------------------------------------------------------------------

def cmd_token_create(args: argparse.Namespace) -> int:
    secret, token_id = create_token(args.tenant, args.name)
    if args.login:
        url = normalize_url(os.environ.get("PIPETTE_URL") or Target.resolve().url)
        write_config(config_path(), url, secret)
    if args.json:
        out.print_json({"id": token_id, "tenant": args.tenant, "token": secret})
    else:
        print(secret)
        print(f"token {token_id} for tenant {args.tenant!r}: shown once, store it now"
              + (f"; saved for {Target.resolve().url} in {config_path()}" if args.login else
                 " (pipette login --with-token reads it from stdin)"), file=sys.stderr)
    return EXIT_OK


def create_token(tenant: str, name: str) -> tuple[str, int]:
    """A new token in the service's database (``PIPETTE_DATABASE_URL`` / ``PIPETTE_HOME``), the
    same code as ``pipette-admin token create``."""
    from sqlalchemy.exc import SQLAlchemyError

    from service.auth import create_token as make
    from service.db import Database
    from service.settings import Settings

    settings = Settings.from_env()
    db = Database(settings.database_url)
    try:
        with db.write() as session:
            token, secret = make(session, tenant, name)
            token_id = int(token.id)
    except SQLAlchemyError as e:
        first = str(getattr(e, "orig", None) or e).splitlines()[0]
        raise ApiError(f"database: {first}", field="PIPETTE_DATABASE_URL",
                       fix="run this where the service's database is (PIPETTE_HOME or PIPETTE_DATABASE_URL), after "
                           "`pipette-admin migrate` (pipette serve migrates the embedded one)") from None
    finally:
        db.dispose()
    return secret, token_id


# ---- demo -----------------------------------------------------------------------------

def cmd_demo(args: argparse.Namespace) -> int:
    """Start the service on embedded defaults (unless one answers), log in, register this
    machine as a 2-device cluster, submit the tiny CPU job, watch it, and print the best
    configuration and the dashboard's address."""
    from cli.client_jobfile import load_job_file
    from cli.client_jobs import cmd_best
    from cli.client_watch import watch

    url = normalize_url(os.environ.get("PIPETTE_URL") or f"http://127.0.0.1:{args.port}")
    os.environ["PIPETTE_URL"] = url
    started = _ensure_service(url, args.port)
    api = _demo_client(url)
    try:
        api.get("/v1/clusters/local")
    except ApiError as e:
        if e.exit_code != EXIT_NOT_FOUND:
            raise
        api.post("/v1/clusters", {"name": "local", "kind": "local", "devices": 2})
        print("registered this machine as cluster 'local' (2 CPU devices)")
    job_file = Path(args.job) if args.job else DEMO_JOB
    body = load_job_file(str(job_file)) if job_file.exists() else dict(DEMO_BODY)
    accepted = api.post("/v1/jobs", body)
    job_id = accepted["id"]
    print(f"submitted {job_file if job_file.exists() else 'the built-in demo job'} as job {job_id}\n")
    code = watch(api, job_id)
    if code == EXIT_OK:
        print()
        cmd_best(argparse.Namespace(job=job_id, out=args.out, json=False))
        ds = Path(args.out) / "ds_config.json"
        if ds.exists():
            print(f"\n{ds}:\n{json.dumps(json.loads(ds.read_text()), indent=2)}")
    print(f"\ndashboard: {url}/#/jobs/{job_id}  (log in with the token in {config_path()})")
    if started is not None:
        print(f"the service keeps running (pid {started}, log {_home() / 'serve.log'}); stop it with: kill {started}")
    return code


def _home() -> Path:
    return Path(os.environ.get("PIPETTE_HOME") or Path.home() / ".pipette").expanduser()


def _ensure_service(url: str, port: int) -> int | None:
    """The pid of a service started here, or None when one already answers at ``url``."""
    probe = Client(Target(url, None, ""), need_token=False)
    try:
        probe.get("/healthz")
        print(f"using the service at {url}")
        return None
    except ApiError as e:
        if e.exit_code != EXIT_UNREACHABLE:
            raise
    home = _home()
    home.mkdir(parents=True, exist_ok=True)
    log = (home / "serve.log").open("ab")
    # A list of arguments, never a shell; its own session so it outlives this command.
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", str(port)], stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    print(f"starting the service at {url} (pid {proc.pid}, log {home / 'serve.log'}) ...", flush=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ApiError(f"the service exited with code {proc.returncode}", field="pipette serve",
                           fix=f"see {home / 'serve.log'}", exit_code=EXIT_ERROR)
        try:
            probe.get("/healthz")
            return proc.pid
        except ApiError:
            time.sleep(1.0)
    raise ApiError("the service did not answer within 180 s", field="pipette serve",
                   fix=f"see {home / 'serve.log'}", exit_code=EXIT_UNREACHABLE)


def _demo_client(url: str) -> Client:
    """The saved login if the service takes it; else a new token for tenant ``demo`` (the demo
    runs where the service's database is), saved as the login."""
    target = Target.resolve()
    if target.token:
        try:
            api = Client(Target(url, target.token, target.source))
            api.get("/v1/clusters")
            return api
        except ApiError as e:
            if e.exit_code != EXIT_AUTH:
                raise
    secret, _ = create_token("demo", "pipette demo")
    write_config(config_path(), url, secret)
    print(f"made a token for tenant 'demo' and saved it in {config_path()}")
    return Client(Target(url, secret, str(config_path())))
