"""GET / and GET /ui/{file}: the chat page, its script and its style, shipped in the package.

The files are read once, when the app is built, and served with a strong ETag (304 on a match)
and a Content-Security-Policy that allows only this server's own scripts, styles and fetches.
"""
import hashlib
from importlib import resources

import falcon

from ...errors import MethodNotAllowed, NotFound

FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8",
         "style.css": "text/css; charset=utf-8", "favicon.svg": "image/svg+xml"}
# NOTE(csp): no inline script or style and no origin but ours, so model text that slipped into
# the DOM as markup still could not run or call out.
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
PAGE_PATHS = ("/",) + tuple(f"/ui/{name}" for name in FILES)
SINK_PATTERN = r"^/(?:ui/(?P<name>[A-Za-z0-9_.-]+))?$"


def load_files():
    """{name: (bytes, media type, etag)} for the page's files, read from the package."""
    root = resources.files("turbospark_wsgi.http") / "static"
    out = {}
    for name, media in FILES.items():
        body = (root / name).read_bytes()
        out[name] = (body, media, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')
    return out


class WebUi:
    """A Falcon sink for `/` and `/ui/{name}` (a sink, since these are not API routes)."""

    def __init__(self):
        self._files = load_files()

    def __call__(self, req, resp, name=None):
        # NOTE(one-url): the page lives at `/` only, the one page path left open under API keys
        name = "index.html" if name is None else name
        if name not in self._files or (name == "index.html" and req.path != "/"):
            raise NotFound(f"Unknown route: {req.method} {req.path}")
        if req.method not in ("GET", "HEAD"):
            raise MethodNotAllowed(f"Method {req.method} is not allowed for {req.path}",
                                   headers={"Allow": "GET, HEAD"})
        body, media, etag = self._files[name]
        resp.set_header("ETag", etag)
        resp.set_header("Cache-Control", "no-cache")
        resp.set_header("Content-Security-Policy", CSP)
        resp.set_header("X-Content-Type-Options", "nosniff")
        resp.set_header("Referrer-Policy", "no-referrer")
        if _matches(req.get_header("If-None-Match"), etag):
            resp.status = falcon.HTTP_304
            return
        resp.content_type = media
        resp.data = body


def _matches(header, etag):
    """True if an If-None-Match header names `etag` (weakly compared, as RFC 9110 asks) or is '*'."""
    tags = [t.strip().removeprefix("W/") for t in (header or "").split(",")]
    return etag in tags or "*" in tags
