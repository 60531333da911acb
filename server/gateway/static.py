"""The browser chat UI's files, served by the gateway over plain HTTP GET.

``GET /`` is the UI's ``index.html``; ``/ui/``, ``/src/`` and ``/vendor/`` map one-to-one onto those folders
of ``client_js/``, so the UI's relative ES module imports (``../src/browser.js`` → ``../vendor/...``) resolve
the same way on disk and over HTTP, and nothing is fetched from a CDN. Only files with a known type, inside
those folders, are served; anything else is a 404.
"""

from __future__ import annotations

import email.utils
from http import HTTPStatus
from pathlib import Path
from urllib.parse import unquote

from websockets.datastructures import Headers
from websockets.http11 import Response

from server.gateway.ui_config import content_security_policy

CLIENT_JS = Path(__file__).resolve().parents[2] / "client_js"
FOLDERS = ("ui", "src", "vendor")
INDEX = ("ui", "index.html")

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".json": "application/json",
}

# The UI renders model output as text nodes, and this keeps it that way even if a bug slipped through:
# no inline script, no eval, scripts and styles from this origin only, WebSockets to this server and the
# origins it lists (ui_config.py builds the policy per request).
CONTENT_SECURITY_POLICY = content_security_policy(None, ())


def resolve(path: str, root: Path = CLIENT_JS) -> Path | None:
    """The file a request path names, or None when it names nothing servable.

    Refuses ``..``, ``.``, empty and hidden segments (also when percent-encoded), backslashes and NULs,
    paths outside :data:`FOLDERS`, files of unknown type, and anything whose real path (after symlinks)
    leaves its folder.
    """
    path = path.split("?", 1)[0].split("#", 1)[0]
    if path in ("/", "/index.html"):
        parts = list(INDEX)
    else:
        if not path.startswith("/"):
            return None
        parts = unquote(path[1:], errors="strict").split("/") if "%" in path else path[1:].split("/")
        if len(parts) < 2 or parts[0] not in FOLDERS:
            return None
        for part in parts:
            if not part or part.startswith(".") or "\\" in part or "\x00" in part:
                return None
    folder = (root / parts[0]).resolve()
    try:
        target = folder.joinpath(*parts[1:]).resolve(strict=True)
    except (OSError, RuntimeError):
        return None
    if not target.is_relative_to(folder) or not target.is_file():
        return None
    if target.suffix not in CONTENT_TYPES:
        return None
    return target


def static_response(
    path: str, root: Path = CLIENT_JS, *, csp: str = CONTENT_SECURITY_POLICY
) -> Response | None:
    """A 200 response with the file ``path`` names (see :func:`resolve`), or None: the caller sends 404.
    HTML pages carry ``csp`` as their Content-Security-Policy."""
    try:
        target = resolve(path, root)
    except UnicodeDecodeError:
        return None
    if target is None:
        return None
    try:
        body = target.read_bytes()
    except OSError:
        return None
    headers = Headers(
        [
            ("Date", email.utils.formatdate(usegmt=True)),
            ("Connection", "close"),
            ("Content-Length", str(len(body))),
            ("Content-Type", CONTENT_TYPES[target.suffix]),
            ("Cache-Control", "no-cache"),
            ("X-Content-Type-Options", "nosniff"),
            ("Referrer-Policy", "no-referrer"),
        ]
    )
    if target.suffix == ".html":
        headers["Content-Security-Policy"] = csp
        headers["X-Frame-Options"] = "DENY"
    return Response(HTTPStatus.OK.value, HTTPStatus.OK.phrase, headers, body)
