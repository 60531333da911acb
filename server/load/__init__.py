"""``tokenwire load``: a WebSocket load generator and measuring client for a running tokenwire server.

Modules, one noun each: ``options`` (the run's configuration and its command-line flags), ``connection``
(a metered protocol client), ``conversation`` (one user's multi-turn session with planned connection kills
and resumes), ``integrity`` (offset and replay checks), ``idle`` (heartbeat-only connections), ``wire``
(bytes per streamed token against an OpenAI-style SSE stream), ``runner`` (arrivals, bounds, the shared
tallies), ``live`` (the progress bar) and ``report`` (JSON, table, PNG).

This package file imports nothing heavy: ``tokenwire``'s argument parser imports ``options`` on every
command.
"""

from __future__ import annotations
