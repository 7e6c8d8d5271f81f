"""The ops console: ``GET /admin/ui`` serves one static page (``gateway/http/console_static/``: HTML, vanilla JS, CSS,
no build step, nothing fetched from another origin) that signs in with the admin token and then reads and steers
the gateway through the same admin API ``tandem ctl`` uses (``/admin/config``, ``/admin/weights``,
``/admin/rollback``, ``/admin/rollouts``, ``/admin/parity``, ``/admin/usage``, ``/admin/limits``,
``/admin/explain``), polling every few seconds.

The page itself is an inert shell holding no data: every byte of state and every action goes through the admin
API with the token as a bearer header, kept in the tab's ``sessionStorage`` (no cookie, so no cross-site request
can act with it). A strict Content-Security-Policy allows scripts, styles and connections to this origin only."""

from __future__ import annotations

from importlib import resources

from litestar import HttpMethod, Response, route
from litestar.exceptions import NotFoundException
from litestar.params import FromPath

# asset name -> media type; the only files served (no path from the request reaches the filesystem)
_ASSETS = {"index.html": "text/html", "charts.js": "text/javascript", "console.js": "text/javascript",
           "console.css": "text/css"}   # Litestar adds "; charset=utf-8"
_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
                               "img-src 'self' data:; form-action 'none'; frame-ancestors 'none'; base-uri 'none'",
    "x-content-type-options": "nosniff", "referrer-policy": "no-referrer", "cache-control": "no-cache",
    "x-frame-options": "DENY",
}


def _asset(name: str) -> Response:
    media_type = _ASSETS.get(name)
    if media_type is None:
        raise NotFoundException(f"no console asset {name!r}")
    data = resources.files("gateway.http").joinpath("console_static", name).read_bytes()
    return Response(data, media_type=media_type, headers=_HEADERS)


@route("/admin/ui", http_method=[HttpMethod.GET, HttpMethod.HEAD], include_in_schema=False)
async def console_page() -> Response:
    return _asset("index.html")


@route("/admin/ui/{name:str}", http_method=[HttpMethod.GET, HttpMethod.HEAD], include_in_schema=False)
async def console_asset(name: FromPath[str]) -> Response:
    """``charts.js``, ``console.js`` and ``console.css``; 404 for any other name."""
    return _asset(name)


CONSOLE_HANDLERS = [console_page, console_asset]
