"""The web page at ``/``: static files shipped in the package, served as is.

No build step: ``frontend/web/`` holds plain HTML, CSS and JavaScript modules,
read once when the app is built. Like llama.cpp's server, these paths are
public (``frontend.auth``): the page itself asks for the API key when the API
answers 401.

Caching: every file carries a strong ETag (a hash of its bytes) and
``Cache-Control: no-cache``, so a browser revalidates each load and gets
``304`` while the file is unchanged, and never runs a stale module after an
upgrade. A strict Content-Security-Policy allows only this origin's scripts,
styles and fetches, and nothing inline: even if model output reached the DOM
as HTML, it could not run a script.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import falcon

WEB_DIR = Path(__file__).with_name("web")

#: URL path -> file in ``WEB_DIR``. Every file the page loads is listed here,
#: and only these are served (no directory lookup from a client's path).
PAGE_FILES: dict[str, str] = {
    "/": "index.html",
    "/index.html": "index.html",
    "/bundle.js": "bundle.js",
    "/bundle.css": "bundle.css",
    "/web/api.js": "api.js",
    "/web/chat.js": "chat.js",
    "/web/markdown.js": "markdown.js",
    "/web/pool.js": "pool.js",
    "/web/store.js": "store.js",
}

#: The paths that need no API key (added to ``frontend.auth.PUBLIC_PATHS``).
PUBLIC_PAGE_PATHS = frozenset(PAGE_FILES)

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}

CONTENT_SECURITY_POLICY = "; ".join([
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    "connect-src 'self'",
    "img-src 'self' data:",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
])


@dataclasses.dataclass(frozen=True)
class PageFile:
    """One file's bytes and the headers that go with them."""

    data: bytes
    content_type: str
    etag: str

    @classmethod
    def load(cls, path: Path) -> PageFile:
        data = path.read_bytes()
        return cls(data, CONTENT_TYPES[path.suffix],
                   hashlib.sha256(data).hexdigest()[:32])


class PageFileResource:
    """``GET``/``HEAD`` of one static file, with ETag revalidation."""

    def __init__(self, page_file: PageFile) -> None:
        self.file = page_file

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = self.file.content_type
        resp.etag = self.file.etag
        resp.cache_control = ["no-cache"]
        resp.set_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        resp.set_header("X-Content-Type-Options", "nosniff")
        resp.set_header("Referrer-Policy", "no-referrer")
        if self._not_modified(req):
            resp.status = falcon.HTTP_304
            return
        resp.data = self.file.data

    on_head = on_get

    def _not_modified(self, req: falcon.Request) -> bool:
        # Falcon parses If-None-Match into ETag objects (or ['*']).
        tags = req.if_none_match or []
        return any(tag == "*" or tag == self.file.etag for tag in tags)


def add_page_routes(app: falcon.App) -> None:
    """Route every page file; each is read here, once, not per request."""
    loaded: dict[str, PageFile] = {}
    for url, name in PAGE_FILES.items():
        if name not in loaded:
            loaded[name] = PageFile.load(WEB_DIR / name)
        app.add_route(url, PageFileResource(loaded[name]))
