"""The service's secret values, blanked out of what a trial's output stores and serves.

A tenant's script runs as another user and gets none of the service's credentials
(``workers.host.script_user``, ``workers.host.script_env``); should one reach it anyway (an
operator's setting passed on, a file left readable), it must not come back through the API in
the trial's output or error. So every text the driver stores from a trial (its record, its
events, the job's error) has the known secret values replaced by ``[redacted]``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

MARK = "[redacted]"
#: shorter values are not secrets worth the name (and would blank common words)
MIN_LENGTH = 6


class Redactor:
    def __init__(self, values: Iterable[str | None]) -> None:
        # longest first: a URL is blanked whole before the password inside it
        self.values = sorted({v for v in values if v and len(v) >= MIN_LENGTH}, key=len, reverse=True)

    def text(self, text: str) -> str:
        for value in self.values:
            text = text.replace(value, MARK)
        return text

    def data(self, value: Any) -> Any:
        """``value`` (JSON-like: dicts, lists, strings) with every string redacted."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {k: self.data(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.data(v) for v in value]
        return value

    def found(self, value: Any) -> bool:
        return bool(self.data(value) != value)


def service_secrets(database_url: str, metrics_token: str | None,
                    environ: Mapping[str, str] | None = None) -> Redactor:
    """The values to blank: the database URL and its password, the metrics token, Ray's token
    (its variable or its file) and any ``PIPETTE_*``/``RAY_*`` variable that names a secret."""
    from workers.host.script_env import SECRET

    env = os.environ if environ is None else environ
    values: list[str | None] = [database_url, metrics_token, env.get("PIPETTE_DATABASE_URL")]
    for url in (database_url, env.get("PIPETTE_DATABASE_URL")):
        values += _url_parts(url)
    values += [v for k, v in env.items() if k.startswith(("PIPETTE_", "RAY_")) and SECRET.search(k)]
    values.append(_ray_token(env))
    return Redactor(values)


def _url_parts(url: str | None) -> list[str | None]:
    if not url:
        return []
    try:
        parsed = make_url(url)
    except ArgumentError:
        return []
    return [parsed.password if isinstance(parsed.password, str) else None,
            parsed.render_as_string(hide_password=False)]


def _ray_token(env: Mapping[str, str]) -> str | None:
    if env.get("RAY_AUTH_TOKEN"):
        return env["RAY_AUTH_TOKEN"]
    path = Path(env.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
