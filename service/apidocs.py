"""``/docs`` (Swagger UI) and ``/redoc`` from files shipped in the Python environment, so the API
reference works on a machine without internet access (FastAPI's defaults load both from a
public CDN, and the pages were blank offline: issue 17 item 25).

The assets come from the ``fastapi-offline`` package (Swagger UI 5, which renders the OpenAPI
3.1 that FastAPI writes; ``swagger-ui-bundle`` ships 4.x, which does not). A fixed list of
files is served: no request path reaches the file system.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, Response

from service.errors import NotFoundError

PREFIX = "/docs-assets"
MEDIA = {"swagger-ui-bundle.js": "text/javascript; charset=utf-8", "swagger-ui.css": "text/css; charset=utf-8",
         "redoc.standalone.js": "text/javascript; charset=utf-8", "favicon.png": "image/png"}


def _asset_bytes(name: str) -> bytes | None:
    try:
        return (resources.files("fastapi_offline") / "static" / name).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError):
        return None


def install_docs(app: FastAPI) -> None:
    """Serve ``/docs`` and ``/redoc`` with local assets (create the app with ``docs_url=None,
    redoc_url=None``)."""
    router = APIRouter(include_in_schema=False)
    title = f"{app.title} API"

    @router.get("/docs")
    def swagger() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=app.openapi_url or "/openapi.json", title=title,
                                   swagger_js_url=f"{PREFIX}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{PREFIX}/swagger-ui.css",
                                   swagger_favicon_url=f"{PREFIX}/favicon.png")

    @router.get("/redoc")
    def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url=app.openapi_url or "/openapi.json", title=title,
                              redoc_js_url=f"{PREFIX}/redoc.standalone.js",
                              redoc_favicon_url=f"{PREFIX}/favicon.png", with_google_fonts=False)

    @router.get(PREFIX + "/{name}")
    def asset(name: str) -> Response:
        data = _asset_bytes(name) if name in MEDIA else None
        if data is None:
            raise NotFoundError(f"no API docs file {name!r}", field="path",
                                fix="open /docs; if it is blank, install the service extra "
                                    "(pip install -e '.[service]')")
        return Response(data, media_type=MEDIA[name], headers={"Cache-Control": "max-age=86400"})

    app.include_router(router)
