"""The JS client library and the browser chat UI, tested by Node's test runner (client_js/test/).

The Node tests start, stop and restart the real ``tokenwire serve`` themselves (tiny model, this Redis,
a key prefix of their own) and drive headless Chromium through playwright-core; this test gives them the
environment, runs them, and checks that they ran and passed. ``make js-deps`` installs what they need
(``npm ci`` in client_js/, and Debian's chromium).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parents[2]
CLIENT_JS = ROOT / "client_js"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = Path(os.environ.get("TOKENWIRE_CHROMIUM", "/usr/bin/chromium"))
INSTALL = "run `make js-deps` (npm ci in client_js/ and apt-get install chromium)"
SUMMARY = re.compile(r"^\S+ (tests|pass|fail|cancelled|skipped|todo) (\d+)$", re.MULTILINE)


def _missing() -> str | None:
    if shutil.which("node") is None:
        return f"node is not installed (Node.js 20+ is needed for the JS tests); then {INSTALL}"
    for package in ("@msgpack/msgpack", "ws", "playwright-core"):
        if not (CLIENT_JS / "node_modules" / package / "package.json").is_file():
            return f"client_js/node_modules/{package} is missing: {INSTALL}"
    if not CHROMIUM.is_file():
        return f"Chromium is not installed at {CHROMIUM}: {INSTALL}"
    return None


def test_js_client_and_browser_ui(tiny_model_dir: Path, redis_url: str) -> None:
    missing = _missing()
    if missing:
        pytest.fail(missing)
    prefix = f"twtest:js:{uuid.uuid4().hex[:10]}:"
    env = {
        **os.environ,
        "TOKENWIRE_PYTHON": sys.executable,
        "TOKENWIRE_MODEL_DIR": str(tiny_model_dir),
        "TOKENWIRE_REDIS_URL": redis_url,
        "TOKENWIRE_KEY_PREFIX": prefix,
        "TOKENWIRE_ARTIFACTS": str(ARTIFACTS),
        "TOKENWIRE_CHROMIUM": str(CHROMIUM),
        "NO_COLOR": "1",
    }
    cmd = ["node", "--test", "--test-concurrency=1", "--test-reporter=spec", "client_js/test/"]
    # A session of its own, so that a timeout kills the servers and browsers the Node tests started too.
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the JS tests did not finish in 240 s:\n{out[-20000:]}")
    finally:
        r = redis.Redis.from_url(redis_url)
        for key in r.scan_iter(match=f"{prefix}*", count=500):
            r.delete(key)
        r.close()
    counts = {k: int(v) for k, v in SUMMARY.findall(out)}
    assert proc.returncode == 0, f"node --test failed ({proc.returncode}):\n{out[-20000:]}"
    assert counts.get("tests", 0) > 0, f"no JS test ran:\n{out[-5000:]}"
    assert counts["fail"] == 0 and counts.get("cancelled", 0) == 0, out[-20000:]
    assert counts["pass"] == counts["tests"], out[-20000:]
    screenshots = re.findall(r"^screenshot: (\S+\.png)$", out, re.MULTILINE)
    assert screenshots, f"the browser test saved no screenshot:\n{out[-5000:]}"
    for path in screenshots:
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path
    print(f"JS tests: {counts['pass']} passed; screenshots: {', '.join(screenshots)}")
