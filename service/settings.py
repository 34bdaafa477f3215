"""The service's settings, read once from the environment.

Embedded default: a SQLite file under ``PIPETTE_HOME`` (``~/.pipette``) and a local Ray; on a
cluster, PostgreSQL through ``PIPETTE_DATABASE_URL`` and the Ray cluster at ``RAY_ADDRESS``.
A bad value is a ``SpecError`` naming the variable, so the service refuses to start with one
line instead of a traceback.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from pipette.errors import SpecError
from pipette.options import TRIAL_TIMEOUT_S

MiB = 1024**2
#: The request-body limit (``PIPETTE_MAX_BODY_BYTES``) by default, and the most it may be set to.
#: It is the one bound on what a client may send, a script's zipped working folder (``script.files``,
#: whose schema bound is the ceiling) included; ``GET /v1/limits`` tells a client the value in force.
DEFAULT_MAX_BODY_BYTES = 1 * MiB
MAX_BODY_BYTES_CEILING = 64 * MiB


@dataclass(frozen=True)
class Settings:
    database_url: str
    home: Path
    #: the Ray cluster this process drives trials on; None: a local Ray on this host
    ray_address: str | None = None
    #: run the scheduler thread inside the API process (else run ``python -m service.worker``)
    scheduler: bool = True
    #: largest request body accepted, in bytes (413 above it)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: a lease not renewed for this long is free again (its holder is presumed dead)
    lease_ttl_s: float = 30.0
    #: how often an idle scheduler looks for work
    poll_s: float = 1.0
    #: the wall-clock limit of a trial whose job gives none (``budget.trial_timeout_s``)
    trial_timeout_s: float = TRIAL_TIMEOUT_S
    #: how long a job waits for lost Ray nodes to come back before it fails
    node_wait_s: float = 1800.0
    #: a verified token is trusted this long without a query (a revocation takes this long)
    token_cache_s: float = 5.0
    #: this host's name, used for the lease of the embedded ("local") cluster
    hostname: str = socket.gethostname()
    #: the operator's credential for /metrics (every tenant's counts): a Bearer token that is
    #: not a tenant's; None: /metrics is off
    metrics_token: str | None = None
    #: queued jobs and profiles a tenant may have at once (429 above it), so one tenant's
    #: requests cannot fill the queue of devices other tenants share
    max_queued_per_tenant: int = 20
    #: event streams a tenant may have open at once in one API process, and all tenants
    #: together (429 above either): each open stream polls the database
    max_streams_per_tenant: int = 20
    max_streams: int = 200
    #: what-if plans a tenant may ask for a minute in one API process (429 above it)
    plans_per_minute: int = 60
    #: clusters a tenant may register (409 above it)
    max_clusters_per_tenant: int = 50
    #: an event stream that sent no event for this long ends (EventSource reconnects by itself)
    stream_idle_s: float = 300.0
    #: answer the polled reads from memory until PostgreSQL notifies a change (``service.changes``)
    read_cache: bool = True
    #: the OS user tenants' scripts run as (``workers.host.script_user``); None: ``nobody`` when
    #: the service runs as root, else a script job fails at once saying how to set one
    script_user: str | None = None
    #: a request's headers must arrive within this long (408), its body within this long plus
    #: its size at 64 KiB/s (closed): slow clients cannot hold connections (``service.protocol``)
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    #: connections held at once, in all (0: as many as the file-descriptor limit leaves) and from
    #: one client address (0: no cap, for a service behind a reverse proxy that caps them)
    max_connections: int = 0
    max_connections_per_client: int = 512

    @property
    def resource_key(self) -> str:
        """The devices this process can drive: a lease is held on this key, not on a cluster
        row, so two registered clusters on the same devices never run trials at once."""
        return resource_key("ray" if self.ray_address else "local", self.ray_address or self.hostname)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        home = Path(env.get("PIPETTE_HOME") or Path.home() / ".pipette").expanduser()
        url = env.get("PIPETTE_DATABASE_URL") or f"sqlite:///{home / 'pipette.db'}"
        return cls(
            database_url=normalize_url(url),
            home=home,
            ray_address=_ray_address(env),
            scheduler=_flag(env, "PIPETTE_SCHEDULER", True),
            max_body_bytes=int(_number(env, "PIPETTE_MAX_BODY_BYTES", DEFAULT_MAX_BODY_BYTES, minimum=1024,
                                       maximum=MAX_BODY_BYTES_CEILING)),
            lease_ttl_s=_number(env, "PIPETTE_LEASE_TTL_S", 30.0, minimum=1.0),
            poll_s=_number(env, "PIPETTE_POLL_S", 1.0, minimum=0.05),
            trial_timeout_s=_number(env, "PIPETTE_TRIAL_TIMEOUT_S", TRIAL_TIMEOUT_S, minimum=1.0),
            node_wait_s=_number(env, "PIPETTE_NODE_WAIT_S", 1800.0, minimum=0.0),
            token_cache_s=_number(env, "PIPETTE_TOKEN_CACHE_S", 5.0, minimum=0.0),
            metrics_token=env.get("PIPETTE_METRICS_TOKEN") or None,
            max_queued_per_tenant=int(_number(env, "PIPETTE_MAX_QUEUED_PER_TENANT", 20, minimum=1)),
            max_streams_per_tenant=int(_number(env, "PIPETTE_MAX_STREAMS_PER_TENANT", 20, minimum=1)),
            max_streams=int(_number(env, "PIPETTE_MAX_STREAMS", 200, minimum=1)),
            plans_per_minute=int(_number(env, "PIPETTE_PLANS_PER_MINUTE", 60, minimum=1)),
            max_clusters_per_tenant=int(_number(env, "PIPETTE_MAX_CLUSTERS_PER_TENANT", 50, minimum=1)),
            stream_idle_s=_number(env, "PIPETTE_STREAM_IDLE_S", 300.0, minimum=1.0),
            read_cache=_flag(env, "PIPETTE_READ_CACHE", True),
            script_user=env.get("PIPETTE_SCRIPT_USER") or None,
            header_timeout_s=_number(env, "PIPETTE_HEADER_TIMEOUT_S", 10.0, minimum=0.5),
            body_timeout_s=_number(env, "PIPETTE_BODY_TIMEOUT_S", 30.0, minimum=1.0),
            max_connections=int(_number(env, "PIPETTE_MAX_CONNECTIONS", 0, minimum=0)),
            max_connections_per_client=int(_number(env, "PIPETTE_MAX_CONNECTIONS_PER_CLIENT", 512, minimum=0)),
        )


def resource_key(kind: str, address: str) -> str:
    """The key of the devices behind a cluster address. A Ray cluster is named by its head's
    host, resolved to an address: the scheduler reaches it through Ray Client
    (``ray://head:10001``) while users register it by its GCS address (``head:6380``) or by IP,
    and all of them must meet on one lease."""
    if kind != "ray":
        return f"{kind}:{address}"
    return f"ray:{ray_head_host(address)}"


def ray_head_host(address: str) -> str:
    """``ray://head:10001``, ``head:6380``, ``head`` -> the head's IP address (or its name when
    it does not resolve here)."""
    host = split_ray_address(address)[0] or address
    try:
        return socket.gethostbyname(host)
    except (OSError, UnicodeError):
        return host


def split_ray_address(address: str) -> tuple[str | None, int | None]:
    """``ray://head:10001``, ``head:6380`` or ``head`` -> (host, port or None).

    Raises SpecError (field ``address``) for what is not an address, e.g. ``0[`` (an unclosed
    IPv6 bracket) or ``head:abc`` (a port that is not a number)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(address if "://" in address else f"ray://{address}")
        return parts.hostname, parts.port
    except ValueError as e:
        raise SpecError(f"{address!r} is not a Ray address ({e})", field="address",
                        fix="give HOST:PORT or ray://HOST:PORT, e.g. 10.0.0.1:6380") from None


def normalize_url(url: str) -> str:
    """``postgresql://`` means psycopg 3 here (SQLAlchemy's default driver, psycopg2, is not
    installed); ``postgres://`` (Heroku style) is accepted too."""
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    if not url.startswith(("sqlite://", "postgresql+")):
        raise SpecError(
            f"unsupported database URL scheme in {url.split(':', 1)[0]!r}", field="PIPETTE_DATABASE_URL",
            fix="use sqlite:///path/to/pipette.db or postgresql+psycopg://user@host/db",
        )
    return url


def _ray_address(env: Mapping[str, str]) -> str | None:
    raw = env.get("RAY_ADDRESS") or None
    if raw is not None:
        try:
            split_ray_address(raw)
        except SpecError as e:
            raise SpecError(e.message, field="RAY_ADDRESS", fix=e.fix) from None
    return raw


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise SpecError(f"is {raw!r}", field=name, fix="use 1 or 0")


def _number(env: Mapping[str, str], name: str, default: float, minimum: float,
            maximum: float | None = None) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise SpecError(f"is {raw!r}, not a number", field=name, fix=f"give a number of at least {minimum:g}") from None
    if not value >= minimum:
        raise SpecError(f"is {raw}", field=name, fix=f"give a number of at least {minimum:g}")
    if maximum is not None and value > maximum:
        raise SpecError(f"is {raw}, more than the most it may be ({maximum:.15g})", field=name,
                        fix=f"give a number from {minimum:.15g} to {maximum:.15g}")
    return value
