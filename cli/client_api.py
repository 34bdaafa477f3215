"""The CLI's view of the service: where it is, who we are, and its REST API over HTTP.

Where and who come from ``PIPETTE_URL`` / ``PIPETTE_TOKEN`` first, then the config file that
``pipette login`` writes (``$PIPETTE_CONFIG``, default ``~/.config/pipette/config.json``,
mode 0600 because it holds a secret). HTTP is the standard library's ``urllib``: the CLI
stays installable with the core alone.

Every answer that is not 2xx becomes an ``ApiError`` carrying the service's own ``field``
and ``fix`` (the body is always ``{"error": {"message", "field", "fix"}}``) and the exit
code a script can rely on (see ``EXIT_*``).
"""

from __future__ import annotations

import json
import os
import re
import stat
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from http.client import HTTPException, HTTPResponse
from pathlib import Path
from typing import Any

from pipette.errors import PipetteError

DEFAULT_URL = "http://127.0.0.1:8000"
#: Read timeout of one request; an event stream gets a keep-alive every 15 s, so 60 s of
#: silence means the connection is gone.
TIMEOUT_S = 30.0
STREAM_TIMEOUT_S = 60.0

# Exit codes (documented in docs/cli-and-dashboard.md and in ``pipette --help``).
EXIT_OK = 0
EXIT_ERROR = 1  # bad input, or the service refused the request (4xx)
EXIT_USAGE = 2  # a bad command line (argparse)
EXIT_UNREACHABLE = 3  # no service at the URL, or it failed (5xx)
EXIT_AUTH = 4  # no token, or the service does not accept it (401)
EXIT_NOT_FOUND = 5  # no such job or cluster (404)
EXIT_JOB_FAILED = 6  # watch: the job ended failed
EXIT_JOB_CANCELLED = 7  # watch: the job was cancelled
EXIT_INTERRUPTED = 130  # Ctrl-C (SIGINT)
EXIT_TERMINATED = 143  # SIGTERM (cli.signals: the same in every command)

EXIT_CODES_HELP = """\
exit codes:
  0  success (watch: the job succeeded)     4  not logged in, or the token was refused
  1  bad input, or the service refused it   5  no such job or cluster
  2  bad command line                       6  watch: the job failed
  3  the service cannot be reached          7  watch: the job was cancelled
  130  Ctrl-C (SIGINT)                       143  SIGTERM"""


class ApiError(PipetteError):
    """An error the CLI prints as one line and exits with ``exit_code``."""

    def __init__(self, message: str, *, field: str | None = None, fix: str | None = None,
                 exit_code: int = EXIT_ERROR, status: int | None = None) -> None:
        super().__init__(message, field=field, fix=fix)
        self.exit_code = exit_code
        self.status = status


def config_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    if env.get("PIPETTE_CONFIG"):
        return Path(env["PIPETTE_CONFIG"]).expanduser()
    base = Path(env.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return base / "pipette" / "config.json"


def read_config(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ApiError(f"cannot read {path} ({e.strerror})", field="PIPETTE_CONFIG",
                       fix="fix its permissions, or run `pipette login` again") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        raise ApiError(f"{path} is not valid JSON", field="PIPETTE_CONFIG",
                       fix="delete it and run `pipette login` again") from None
    if not isinstance(data, dict):
        raise ApiError(f"{path} does not hold an object", field="PIPETTE_CONFIG",
                       fix="delete it and run `pipette login` again")
    return data


def write_config(path: Path, url: str, token: str) -> None:
    """Write the login file readable by its owner only (it holds the token)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = read_config(path)
    data.update({"url": url, "token": token})
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    os.chmod(tmp, stat.S_IRUSR | stat.S_IWUSR)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Target:
    """The service to talk to and the token to send."""

    url: str
    token: str | None
    source: str  # where the token came from, for error messages

    @classmethod
    def resolve(cls, env: Mapping[str, str] | None = None) -> Target:
        env = os.environ if env is None else env
        path = config_path(env)
        saved = read_config(path)
        url = env.get("PIPETTE_URL") or str(saved.get("url") or DEFAULT_URL)
        token = env.get("PIPETTE_TOKEN") or None
        source = "PIPETTE_TOKEN"
        if token is None and saved.get("token"):
            token, source = str(saved["token"]), str(path)
        return cls(normalize_url(url), token, source)


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ApiError(f"{url!r} is not an http(s) URL", field="PIPETTE_URL",
                       fix="give the service's address, e.g. http://127.0.0.1:8000")
    return url


class Client:
    """Calls the REST API; one method per HTTP verb, JSON in and out."""

    def __init__(self, target: Target, *, need_token: bool = True) -> None:
        if need_token and not target.token:
            raise ApiError("not logged in", field="PIPETTE_TOKEN", exit_code=EXIT_AUTH,
                           fix="run `pipette login` (or set PIPETTE_TOKEN); an admin makes tokens with "
                               "`pipette token create --tenant NAME`")
        self.target = target

    @property
    def url(self) -> str:
        return self.target.url

    def get(self, path: str, query: Mapping[str, Any] | None = None) -> Any:
        return self._json("GET", path, query=query)

    def post(self, path: str, body: Any = None) -> Any:
        return self._json("POST", path, body=body)

    def delete(self, path: str) -> Any:
        return self._json("DELETE", path)

    def get_text(self, path: str) -> str:
        with self._open("GET", path, accept="*/*") as resp:
            return resp.read().decode()

    def events(self, path: str, last_event_id: int | None = None) -> Iterator[dict[str, Any]]:
        """Server-sent events as dicts (``id``, ``kind``, ``trial``, ``data``, ``at``), until the
        service ends the stream. Comments and ``retry:`` lines are skipped."""
        headers = {"Last-Event-ID": str(last_event_id)} if last_event_id else {}
        with self._open("GET", path, accept="text/event-stream", headers=headers,
                        timeout=STREAM_TIMEOUT_S) as resp:
            data: list[str] = []
            for raw in resp:
                line = raw.decode().rstrip("\r\n")
                if not line:
                    if data:
                        yield json.loads("\n".join(data))
                        data = []
                    continue
                if line.startswith("data:"):
                    data.append(line[5:].lstrip(" "))

    # ---- plumbing ---------------------------------------------------------------------
    def _json(self, method: str, path: str, *, query: Mapping[str, Any] | None = None, body: Any = None) -> Any:
        with self._open(method, path, query=query, body=body) as resp:
            raw = resp.read()
        return json.loads(raw) if raw else None

    def _open(self, method: str, path: str, *, query: Mapping[str, Any] | None = None, body: Any = None,
              accept: str = "application/json", headers: Mapping[str, str] | None = None,
              timeout: float = TIMEOUT_S) -> HTTPResponse:
        url = self.url + path
        if query:
            pairs = [(k, v) for k, v in query.items() if v is not None]
            url += "?" + urllib.parse.urlencode(pairs, doseq=True)
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method)
        request.add_header("Accept", accept)
        request.add_header("User-Agent", "pipette-cli")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.target.token:
            request.add_header("Authorization", f"Bearer {self.target.token}")
        for key, value in (headers or {}).items():
            request.add_header(key, value)
        try:
            resp: HTTPResponse = urllib.request.urlopen(request, timeout=timeout)
            return resp
        except urllib.error.HTTPError as e:
            raise self._api_error(e) from None
        except (TimeoutError, urllib.error.URLError, HTTPException, ConnectionError) as e:
            reason = getattr(e, "reason", None) or e
            raise ApiError(f"cannot reach the service at {self.url} ({reason})", field="PIPETTE_URL",
                           fix="start it with `pipette serve`, or point PIPETTE_URL (or `pipette login --url`) "
                               "at it", exit_code=EXIT_UNREACHABLE) from None

    def _api_error(self, e: urllib.error.HTTPError) -> ApiError:
        try:
            detail = json.loads(e.read() or b"{}").get("error") or {}
        except (json.JSONDecodeError, AttributeError, OSError):
            detail = {}
        message = str(detail.get("message") or e.reason or f"HTTP {e.code}")
        field, fix = detail.get("field"), detail.get("fix")
        code = {401: EXIT_AUTH, 404: EXIT_NOT_FOUND}.get(e.code, EXIT_UNREACHABLE if e.code >= 500 else EXIT_ERROR)
        if e.code == 401:
            fix = (f"the token from {self.target.source} was refused; run `pipette login` with a valid token "
                   "(`pipette token create --tenant NAME` makes one)")
        return ApiError(message, field=field, fix=fix, exit_code=code, status=e.code)


# ---- jobs by id ---------------------------------------------------------------------

FULL_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
PREFIX = re.compile(r"^[0-9a-fA-F-]{1,36}$")


def client() -> Client:
    return Client(Target.resolve())


def resolve_job(api: Client, ref: str) -> str:
    """A full job id from an id or a unique prefix of one (as ``pipette jobs`` shows them)."""
    ref = ref.strip().lower()
    if not PREFIX.match(ref):
        raise ApiError(f"{ref!r} is not a job id", field="JOB", fix="give an id (or its first characters) from "
                       "`pipette jobs`")
    if FULL_ID.match(ref):
        return ref
    found: list[str] = []
    cursor: str | None = None
    while True:
        page = api.get("/v1/jobs", {"limit": 200, "cursor": cursor})
        found += [j["id"] for j in page["items"] if j["id"].startswith(ref)]
        cursor = page.get("next_cursor")
        if not cursor or len(found) > 1:
            break
    if not found:
        raise ApiError(f"no job starts with {ref!r}", field="JOB", fix="see `pipette jobs`", exit_code=EXIT_NOT_FOUND)
    if len(found) > 1:
        raise ApiError(f"{ref!r} matches several jobs ({', '.join(f[:12] for f in found[:4])}...)", field="JOB",
                       fix="give more characters of the id")
    return found[0]
