"""Errors a newcomer meets on the command line: each is one line that says what to do, and a non-zero
exit, never a traceback or a process that hangs (issue 17). One table of invocations; every process is
bounded in time, so a hang fails the test instead of stalling it."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import delete_prefix

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Case:
    name: str
    args: list[str]  # {busy}: a port something listens on; {redis}: REDIS_URL; {model}: the tiny model
    rc: int
    message: str  # must appear in the last line of stderr
    stdout_free_of: str = ""  # e.g. "listening": the failure comes before the server claims to listen


STORE = ["--redis-url", "{redis}", "--key-prefix", "{prefix}"]
GW1_W1 = ["--gateways", "1", "--workers", "1", "--port"]

CASES = [
    Case(
        "gateway on a busy port",
        ["gateway", "--redis-url", "{redis}", "--key-prefix", "{prefix}", "--port", "{busy}"],
        2,
        "port {busy} on 127.0.0.1 is already in use (another tokenwire?): choose another with --port N",
        "listening",
    ),
    Case(
        "serve on a busy port",
        [
            "serve",
            "--redis-url",
            "{redis}",
            "--key-prefix",
            "{prefix}",
            "--model",
            "{model}",
            "--port",
            "{busy}",
        ],
        2,
        "port {busy} on 127.0.0.1 is already in use",
        "listening",
    ),
    Case(
        "cluster with its first gateway's port busy",
        [
            *["cluster", "--redis-url", "{redis}", "--key-prefix", "{prefix}", "--model", "{model}"],
            *GW1_W1,
            "{busy}",
        ],
        2,
        "tokenwire cluster: gateway-0 failed to start (exit 2); stopped",
        "cluster ready",
    ),
    Case(
        "worker metrics port busy",
        [
            *[
                "worker",
                "--redis-url",
                "{redis}",
                "--key-prefix",
                "{prefix}",
                "--model",
                "{model}",
                "--metrics-port",
                "{busy}",
            ]
        ],
        2,
        "--metrics-port {busy} on 127.0.0.1 is already in use (another tokenwire?): choose another with "
        "--metrics-port N",
    ),
    Case(
        "gateway metrics port busy",
        ["gateway", *STORE, "--port", "0", "--metrics-port", "{busy}"],
        2,
        "--metrics-port {busy} on 127.0.0.1 is already in use (another tokenwire?): choose another with "
        "--metrics-port N",
        "listening",
    ),
    Case(
        "a timeout of no time",
        ["serve", "--detach-timeout", "-1"],
        2,
        "argument --detach-timeout: expected at least 0.001 and at most 1e+09 seconds, got -1",
    ),
    Case(
        "a lease of no ms",
        ["worker", "--lease-ttl", "0.0004"],
        2,
        "argument --lease-ttl: expected at least 0.001",
    ),
    Case(
        "a retention of NaN",
        ["gateway", "--retention", "nan"],
        2,
        "argument --retention: expected seconds, got nan",
    ),
    Case(
        "a negative queue limit",
        ["serve", "--max-queued", "-3"],
        2,
        "argument --max-queued: expected 0 or more",
    ),
    Case(
        "a drain of minus", ["serve", "--drain-timeout", "-2"], 2, "argument --drain-timeout: expected 0 and"
    ),
    Case(
        "cluster workers of no threads",
        ["cluster", "--threads-per-worker", "0"],
        2,
        "argument --threads-per-worker: expected at least 1, got 0",
    ),
    Case(
        "a log level nobody has",
        ["serve", "--log-level", "loud"],
        2,
        "argument --log-level: expected one of debug, info, warning, error, got 'loud'",
    ),
    Case("an http Redis URL", ["serve", "--redis-url", "http://x"], 2, "expected redis://host[:port][/db]"),
    Case("a Redis URL of no host", ["gateway", "--redis-url", "redis://"], 2, "'redis://': no host"),
    Case(
        "a Redis database that is no number",
        ["gateway", "--redis-url", "redis://127.0.0.1:6379/abc"],
        2,
        "the database after the host must be a number, got 'abc'",
    ),
    Case(
        "an empty key prefix", ["gateway", "--key-prefix", ""], 2, "argument --key-prefix: must not be empty"
    ),
    Case(
        "cluster gateways past the last port",
        ["cluster", "--port", "65535", "--gateways", "2"],
        2,
        "--port 65535 with --gateways 2 needs ports up to 65536; the last port is 65535",
    ),
    Case(
        "a device torch has not", ["serve", "--device", "tpu"], 2, "expected auto, cpu, cuda, cuda:N or mps"
    ),
    Case(
        "a dtype of three bits", ["worker", "--dtype", "int3"], 2, "argument --dtype: invalid choice: 'int3'"
    ),
    Case("chat at temperature 3", ["chat", "--temperature", "3"], 2, "expected a number from 0 to 2, got 3"),
    Case(
        "Redis unreachable",
        ["gateway", "--redis-url", "redis://127.0.0.1:1/0", "--port", "0"],
        2,
        "cannot reach Redis at redis://127.0.0.1:1/0",
        "listening",
    ),
    Case(
        "Redis password is not printed",
        ["gateway", "--redis-url", "redis://:hunter2@127.0.0.1:1/0", "--port", "0"],
        2,
        "cannot reach Redis at redis://:***@127.0.0.1:1/0",
    ),
    Case("port out of range", ["serve", "--port", "99999"], 2, "expected a port number 0-65535"),
    Case("port not a number", ["gateway", "--port", "http"], 2, "expected a port number 0-65535"),
    Case(
        "UI origin that is not a WebSocket origin",
        ["serve", "--ui-connect", "https://elsewhere.example"],
        2,
        "expected a WebSocket origin such as wss://chat.example.com, got 'https://elsewhere.example'",
    ),
    Case("cluster without gateways", ["cluster", "--gateways", "0"], 2, "--gateways: expected at least 1"),
    Case(
        "model folder missing",
        [
            "serve",
            "--redis-url",
            "{redis}",
            "--key-prefix",
            "{prefix}",
            "--model",
            "/nonexistent",
            "--port",
            "0",
        ],
        2,
        "--model /nonexistent: no such folder",
        "listening",
    ),
    Case(
        "fallback to a model not served",
        [*["serve", *STORE, "--model", "big={model}", "--fallback", "big=light", "--port", "0"]],
        2,
        "--fallback big=light: 'light' is not a served model (big)",
        "listening",
    ),
    Case(
        "two models of one name",
        [*["serve", *STORE, "--model", "a={model}", "--model", "a={model}", "--port", "0"]],
        2,
        "--model: two models named 'a'; name them apart with --model NAME=DIR",
        "listening",
    ),
    Case(
        "model name with a space",
        ["worker", *STORE, "--model", "my model={model}"],
        2,
        "a model name is 1-64 letters, digits, '.', '_' or '-'",
    ),
    Case(
        "fallback without its light model", ["gateway", "--fallback", "big"], 2, "expected MODEL=LIGHT_MODEL"
    ),
    Case(
        "worker model folder missing",
        ["worker", "--redis-url", "{redis}", "--key-prefix", "{prefix}", "--model", "/nonexistent"],
        2,
        "--model /nonexistent: no such folder",
    ),
    Case(
        "chat with the UI's http URL",
        ["chat", "http://127.0.0.1:8765/"],
        2,
        "is the browser UI's address; chat needs the WebSocket endpoint: tokenwire chat ws://127.0.0.1:8765/v1/ws",
    ),
    Case(
        "chat without the endpoint path",
        ["chat", "ws://127.0.0.1:8765/"],
        2,
        "the WebSocket endpoint is /v1/ws: tokenwire chat ws://127.0.0.1:8765/v1/ws",
    ),
    Case(
        "chat with no server there", ["chat", "ws://127.0.0.1:{free}/v1/ws", "-m", "hi"], 1, "cannot connect"
    ),
    Case(
        "chat with a plain web server there",
        ["chat", "ws://127.0.0.1:{http}/v1/ws", "-m", "hi"],
        1,
        "answered HTTP 200, not a WebSocket",
    ),
]


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    """A port something is listening on (as `make run` would be)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


@pytest.fixture(scope="module")
def http_port() -> Iterator[int]:
    """A plain HTTP server that answers 200 to anything (not a WebSocket endpoint)."""

    class Ok(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def _free_port() -> int:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_cli_error_is_one_line_and_nonzero(
    case: Case, busy_port: int, http_port: int, redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    prefix = f"twtest:cli:{uuid.uuid4().hex[:8]}:"
    subs = {
        "busy": str(busy_port),
        "redis": redis_url,
        "prefix": prefix,
        "model": str(tiny_model_dir),
        "free": str(_free_port()),
        "http": str(http_port),
    }
    args = [a.format(**subs) for a in case.args]
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "server.cli", *args],
            cwd=tmp_path,  # embedded data, if any, stays in the test's folder
            env={**os.environ, "PYTHONPATH": str(ROOT), "NO_COLOR": "1"},
            capture_output=True,
            text=True,
            timeout=120,  # a hang (the bug this guards against) fails here
        )
    finally:
        delete_prefix(redis_url, prefix)
    err_lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == case.rc, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert err_lines, proc.stdout
    # The line that says what to do is the last thing printed (after any child's own line and logs).
    assert case.message.format(**subs) in err_lines[-1], proc.stderr[-2000:]
    if case.stdout_free_of:
        assert case.stdout_free_of not in proc.stdout, proc.stdout


def _help(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    from server.cli import main

    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines: compare on one line


def test_help_shows_defaults_and_worker_help_has_no_gateway_flags(capsys: pytest.CaptureFixture[str]) -> None:
    serve = _help("serve", capsys)
    assert "0 picks a free port (printed on stdout) (default: 8765)" in serve
    assert "--kv-budget-mb" in serve and "--ui-connect" in serve
    assert "(default: 2)" in _help("cluster", capsys)
    worker = _help("worker", capsys)
    for gateway_only in (
        "--port ",
        "--auth-secret",
        "--max-queued",
        "--max-inflight-per-user",
        "--degrade",
        "--ui-connect",
    ):
        assert gateway_only not in worker, gateway_only
    assert "--kv-budget-mb" in worker and "--metrics-port" in worker


def test_fallback_without_a_trigger_is_said_at_start() -> None:
    """--fallback alone never moves a chat (issue 29): the server says so; with a trigger it is quiet."""
    import argparse

    from server.cli import fallback_warning

    def args(**kw: object) -> argparse.Namespace:
        base: dict[str, object] = {"command": "serve", "fallback": [("smol", "tiny")]}
        return argparse.Namespace(
            **{**base, "degrade_queue_depth": 0, "degrade_ttft": 0.0, "max_queued": 0, **kw}
        )

    said = fallback_warning(args())
    assert (
        said is not None and "--degrade-queue-depth" in said and said.startswith("tokenwire serve: warning")
    )
    assert fallback_warning(args(degrade_queue_depth=8)) is None  # the README's example
    assert fallback_warning(args(degrade_ttft=2.0)) is None
    assert fallback_warning(args(max_queued=100)) is None
    assert fallback_warning(args(fallback=None)) is None


def test_a_data_folder_that_cannot_be_one_is_said_in_words(tmp_path: Path) -> None:
    """--data-dir naming a file (or a folder it may not create): the embedded Valkey's error, which serve
    and cluster print as their one line, names the folder and the flag (it was a NotADirectoryError)."""
    from server.store.embedded import EmbeddedValkey, EmbeddedValkeyError

    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a folder")
    with pytest.raises(EmbeddedValkeyError, match=r"data folder .*notes\.txt cannot be used .*--data-dir"):
        EmbeddedValkey(a_file).start()


@pytest.mark.parametrize("db", ["\u00b2", "\u0661", "1\u00b2"])
def test_a_redis_database_in_digits_that_are_not_ascii_is_refused(db: str) -> None:
    # str.isdigit() takes them; int(), which redis-py calls on the database, refuses U+00B2 and reads U+0661
    # as 1.
    from server.argtypes import redis_url_problem

    problem = redis_url_problem(f"redis://127.0.0.1:6379/{db}")
    assert problem is not None and "must be a number" in problem
