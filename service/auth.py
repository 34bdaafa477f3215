"""Bearer tokens: created by the admin command, stored as SHA-256 of the secret, one tenant each.

A token is ``pip_<43 url-safe characters>`` (256 random bits), so a plain SHA-256 is enough: it
cannot be brute-forced, and a stolen database yields no usable token. Lookups are by the hash
(an index), and compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from dataclasses import dataclass

from fastapi import Request
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.types import Scope

from pipette.errors import SpecError
from service.errors import AuthError
from service.models import Token, utcnow

PREFIX = "pip_"
#: the scope key under which ``service.gate`` hands the authenticated principal to the routes
PRINCIPAL_KEY = "pipette.principal"
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


@dataclass(frozen=True)
class Principal:
    """Who is calling: the tenant their token belongs to."""

    tenant: str
    token_id: int


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def create_token(session: Session, tenant: str, name: str = "") -> tuple[Token, str]:
    """A new token for ``tenant``; the secret is returned once and never stored."""
    if not TENANT_PATTERN.match(tenant):
        raise SpecError(
            f"tenant {tenant!r} is not a valid name", field="tenant",
            fix="use 1-100 letters, digits, '.', '_' or '-', starting with a letter or digit",
        )
    secret = PREFIX + secrets.token_urlsafe(32)
    token = Token(tenant=tenant, name=name[:200], token_hash=hash_token(secret), prefix=secret[:10])
    session.add(token)
    session.flush()
    return token, secret


def revoke_token(session: Session, token_id: int) -> bool:
    token = session.get(Token, token_id)
    if token is None or token.revoked_at is not None:
        return False
    token.revoked_at = utcnow()
    return True


class TokenCache:
    """Verified tokens for a few seconds, so a busy client costs no query per request; a
    revoked token stops working within ``ttl_s``."""

    def __init__(self, ttl_s: float = 5.0, size: int = 10_000) -> None:
        self.ttl_s = ttl_s
        self.size = size
        self._seen: dict[str, tuple[Principal, float]] = {}
        self._lock = threading.Lock()

    def get(self, secret: str) -> Principal | None:
        with self._lock:
            hit = self._seen.get(hash_token(secret))
        if hit is None or hit[1] < time.monotonic():
            return None
        return hit[0]

    def put(self, secret: str, principal: Principal) -> None:
        with self._lock:
            if len(self._seen) >= self.size:
                self._seen.clear()
            self._seen[hash_token(secret)] = (principal, time.monotonic() + self.ttl_s)


def verify(session: Session, secret: str) -> Principal:
    digest = hash_token(secret)
    token = session.execute(select(Token).where(Token.token_hash == digest)).scalar_one_or_none()
    if token is None or not hmac.compare_digest(token.token_hash, digest) or token.revoked_at is not None:
        raise AuthError("the token is not valid (unknown or revoked)", field="Authorization",
                        fix="send a token made with `pipette-admin token create --tenant NAME`")
    return Principal(tenant=token.tenant, token_id=token.id)


def bearer_secret(request: Request) -> str:
    return bearer_secret_of(request.scope)


def bearer_secret_of(scope: Scope) -> str:
    """The secret of the request's ``Authorization: Bearer`` header (AuthError when there is
    none, or it is of another scheme)."""
    header = next((v for k, v in scope.get("headers") or () if k == b"authorization"), b"").decode("latin-1")
    scheme, _, secret = header.partition(" ")
    if not header:
        raise AuthError("no credentials", field="Authorization",
                        fix="send 'Authorization: Bearer <token>' (pipette-admin token create --tenant NAME)")
    if scheme.lower() != "bearer" or not secret.strip():
        raise AuthError("is not a Bearer token", field="Authorization", fix="send 'Authorization: Bearer <token>'")
    return secret.strip()
