"""The web dashboard: static files served at ``/`` (no build step, nothing from another site).

The page itself holds no data and needs no token; everything it shows comes from the REST
API with the token the person types on its login page (kept in ``sessionStorage`` and sent as
``Authorization: Bearer``). The event stream is read with ``fetch`` so it can carry that
header (``EventSource`` cannot). The Content-Security-Policy allows scripts, styles and
connections to this origin only, so the page cannot load anything from elsewhere even by
mistake.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

from service.errors import NotFoundError

router = APIRouter(include_in_schema=False)
STATIC = Path(__file__).resolve().parent / "static"
MEDIA = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
#: Served files: a fixed list, so no request path ever reaches the file system.
FILES = {p.name: p for p in STATIC.iterdir() if p.suffix in MEDIA} if STATIC.is_dir() else {}
CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
       "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
           "Referrer-Policy": "no-referrer"}


def _file(name: str) -> Response:
    path = FILES.get(name)
    if path is None:
        raise NotFoundError(f"no dashboard file {name!r}", field="path", fix="open the dashboard at /")
    return Response(path.read_bytes(), media_type=MEDIA[path.suffix], headers=HEADERS)


@router.api_route("/", methods=["GET", "HEAD"])
def index() -> Response:
    return _file("index.html")


@router.api_route("/dashboard/{name}", methods=["GET", "HEAD"])
def asset(name: str) -> Response:
    return _file(name)
