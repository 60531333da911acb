"""What the browser chat UI learns from the server it was loaded from (``GET /config.json``): the sampling
defaults (the same ones the worker applies, so the UI and ``tokenwire chat`` give the same answers), the
model's name when this process knows it, and the WebSocket origins the UI may connect to besides its
own (``--ui-connect``). The page's Content-Security-Policy allows exactly those origins and no others, so a
crafted ``/?ws=wss://elsewhere/...`` link cannot make the UI send the conversation it keeps to a stranger.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from urllib.parse import urlsplit

from server.defaults import sampling_defaults

_HOST = re.compile(r"^[A-Za-z0-9.\-]+(:\d{1,5})?$|^\[[0-9A-Fa-f:.]+\](:\d{1,5})?$")


def ws_origin(value: str) -> str:
    """``ws://host[:port]`` or ``wss://...`` from a URL or origin given on the command line; ValueError
    if it is not one (argparse shows the message)."""
    parts = urlsplit(value.strip())
    if parts.scheme not in ("ws", "wss") or not parts.netloc or not _HOST.match(parts.netloc):
        raise ValueError(f"expected a WebSocket origin such as wss://chat.example.com, got {value!r}")
    if parts.username or parts.password:
        raise ValueError(f"a WebSocket origin has no user or password: {value!r}")
    return f"{parts.scheme}://{parts.netloc.lower()}"


def content_security_policy(host: str | None, connect: Sequence[str]) -> str:
    """The UI page's policy: scripts, styles and images from this origin only, no inline script, and
    WebSockets to this host (as the browser named it) and the listed origins only."""
    own = ["'self'"]
    if host and _HOST.match(host):
        own += [f"ws://{host}", f"wss://{host}"]
    return (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
        f"connect-src {' '.join([*own, *connect])}; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )


def ui_config(
    *, connect: Sequence[str], model: str | None, max_tokens: int, models: Sequence[str] = ()
) -> bytes:
    """The body of ``/config.json``: ``model`` is the default model's name, ``models`` every model this
    process serves (the default first; a cluster's gateway knows none: the UI reads welcome.models)."""
    defaults = sampling_defaults()
    body = {
        "defaults": defaults,
        "limits": {"max_tokens": max_tokens},
        "model": model,
        "models": list(models),
        "connect": list(connect),
        "ws_path": "/v1/ws",
    }
    return json.dumps(body, separators=(",", ":")).encode()
