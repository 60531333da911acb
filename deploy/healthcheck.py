"""Container health check without curl: exit 0 when an HTTP GET answers 200, else 1.

The URL is the first argument, else $TOKENWIRE_HEALTHCHECK_URL, else the gateway's /healthz on port 8765.
Proxies from the environment are ignored: the check is always about this container.
"""

from __future__ import annotations

import os
import sys
import urllib.request

DEFAULT_URL = "http://127.0.0.1:8765/healthz"


def main(argv: list[str]) -> int:
    url = argv[1] if len(argv) > 1 else os.environ.get("TOKENWIRE_HEALTHCHECK_URL") or DEFAULT_URL
    timeout = float(os.environ.get("TOKENWIRE_HEALTHCHECK_TIMEOUT") or 3)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            status = response.status
    except (OSError, ValueError) as exc:  # HTTPError (non-2xx) and URLError are OSErrors
        print(f"unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
    if status != 200:
        print(f"unhealthy: {url}: HTTP {status}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
