"""server/bench/gpu.sh, the script for the first GPU, run end to end on this CPU so it cannot rot: the real
bench on the toy preset (``--smoke``), then a fake interpreter for what a GPU run may meet (a run that
crashes, one that times out inside a path, a budget spent), the usage errors, and the pieces of the bench
it relies on (the SmolLM2-1.7B preset, capped output lengths, the cache keyword of older transformers).
No timed assertion: only that every run is in the JSON, with tokens/s where it ran."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from server.bench import paths as bench_paths
from server.bench.models import PRESETS, random_model
from server.engine import llama

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "server" / "bench" / "gpu.sh"
ROW = "padded_loop        100.0 tok/s  TTFT p50      1.0 p99      2.0 ms  ITL p50     3.0 p99     4.0 ms  "

pytestmark = pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils' timeout")


def _script(*args: str, tmp: Path, python: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH")}
    env.update(PYTHON=python or sys.executable, TMPDIR=str(tmp))
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, cwd=tmp, timeout=120
    )


def _probe_wheel(folder: Path) -> Path:
    """A real (pure Python) wheel, built by hand: the script installs the wheels it is given first."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenwire_gpu_probe-0.1-py3-none-any.whl"
    info = "tokenwire_gpu_probe-0.1.dist-info"
    files = {
        "tokenwire_gpu_probe/__init__.py": "VALUE = 1\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: tokenwire-gpu-probe\nVersion: 0.1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"{info}/RECORD", record)
    return path


def _fake_python(tmp: Path) -> str:
    """An interpreter that is the real one except for ``-m server.cli bench``, which plays a run by its
    preset: ``crash`` fails at once, ``hang`` prints padded_loop's row then hangs, ``hangfirst`` hangs
    before any row."""
    fake = tmp / "fakepython"
    fake.write_text(
        f"""#!/bin/sh
if [ "$1" = -m ] && [ "$2" = server.cli ]; then
    prev=; preset=
    for a in "$@"; do [ "$prev" = --random-weights ] && preset=$a; prev=$a; done
    case $preset in
    crash) echo "Traceback: boom on purpose" >&2; exit 3 ;;
    hang) echo "tokenwire bench: fake"; echo "{ROW}"; exec sleep 60 ;;
    hangfirst) echo "tokenwire bench: fake"; exec sleep 60 ;;
    esac
fi
exec "{sys.executable}" "$@"
"""
    )
    fake.chmod(0o755)
    return str(fake)


def test_the_smoke_run_writes_one_entry_per_run_with_tokens_per_second(tmp_path: Path) -> None:
    wheels = _probe_wheel(tmp_path / "wheels").parent
    out = tmp_path / "gpu.json"
    r = _script("--smoke", "gpu.json", "--wheels", str(wheels), tmp=tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert (doc["mode"], doc["device"], doc["status"]) == ("smoke", "cpu", "ok")
    assert [run["name"] for run in doc["runs"]] == ["tiny x2", "tiny x4"]
    for run, n in zip(doc["runs"], (2, 4), strict=True):
        assert (run["status"], run["rc"], run["requests"], run["preset"]) == ("ok", 0, n, "tiny")
        assert run["paths"] == ["padded_loop", "engine"]
        assert set(run["tok_s"]) == {"padded_loop", "engine"}
        assert all(v is not None and v > 0 for v in run["tok_s"].values())
        bench = run["bench"]  # the run's own --json, whole
        assert bench["failed"] == [] and bench["engine"]["tok_s"] == run["tok_s"]["engine"]
        assert run["wall_s"] > 0 and "tokenwire bench --device cpu --random-weights tiny" in run["command"]
    assert [s["run"] for s in doc["summary"]] == ["tiny x2", "tiny x4"]
    assert all(s["engine_over"]["padded_loop"] > 0 for s in doc["summary"])
    # The wheels it was given were installed, and found where the bench runs.
    assert doc["wheels"] == [
        {"wheel": "tokenwire_gpu_probe-0.1-py3-none-any.whl", "version": "0.1", "found": "0.1"}
    ]
    m = doc["machine"]
    assert m["torch"] == torch.__version__ and m["versions"]["transformers"] == transformers.__version__
    assert m["cuda_available"] is False and "nvidia_smi" in m
    assert doc["wall_s"] > 0 and doc["finished"] >= doc["started"]
    assert "useful tokens/s:" in r.stdout and not list(tmp_path.glob("tokenwire-gpu.*"))  # work folder gone


def test_a_failed_or_timed_out_run_is_recorded_and_the_next_one_runs(tmp_path: Path) -> None:
    r = _script(
        "--smoke",
        "--runs",
        "crash:2 hang:3:2 hangfirst:4:2 tiny:5",
        "--paths",
        "padded_loop,engine",
        tmp=tmp_path,
        python=_fake_python(tmp_path),
    )
    assert r.returncode == 1, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads((tmp_path / "gpu-bench.json").read_text())  # the default name, where it was started
    assert doc["status"] == "failed"
    crash, hang, hangfirst, last = doc["runs"]
    assert (crash["status"], crash["rc"]) == ("failed", 3) and "boom on purpose" in crash["stderr_tail"]
    assert crash["tok_s"] == {"padded_loop": None, "engine": None}
    # Timed out inside the engine path: padded_loop's row is kept, and the later runs go without the engine.
    assert (hang["status"], hang["rc"], hang["limit_s"]) == ("timeout", 124, 2)
    assert hang["timed_out_in"] == "engine" and hang["tok_s"] == {"padded_loop": 100.0, "engine": None}
    assert hang["partial"]["padded_loop"]["itl_p99_ms"] == 4.0
    assert hangfirst["paths"] == ["padded_loop"] and hangfirst["timed_out_in"] == "padded_loop"
    assert (last["status"], last["paths"], last["reason"]) == ("skipped", [], "no path left")
    assert doc["not_ok"] == ["crash x2", "hang x3", "hangfirst x4", "tiny x5"]


def test_no_run_starts_once_the_budget_is_spent(tmp_path: Path) -> None:
    r = _script("--smoke", "--budget", "0", "--runs", "tiny:2", tmp=tmp_path, python=_fake_python(tmp_path))
    assert r.returncode == 1
    (run,) = json.loads((tmp_path / "gpu-bench.json").read_text())["runs"]
    assert run["status"] == "skipped" and "budget" in run["reason"]


def test_a_machine_without_the_imports_is_reported_before_any_run(tmp_path: Path) -> None:
    bare = tmp_path / "barepython"  # no site-packages: no torch, no structlog
    bare.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    bare.chmod(0o755)
    r = _script("--smoke", tmp=tmp_path, python=str(bare))
    assert r.returncode == 1
    doc = json.loads((tmp_path / "gpu-bench.json").read_text())
    assert doc["status"] == "error" and doc["runs"] == []
    assert "cannot import torch" in doc["error"] and "--prepare" in doc["error"]


@pytest.mark.parametrize(
    "args",
    [("--runs", "135m"), ("--runs", "135m:x"), ("--budget", "soon"), ("--nonsense",), ("--runs", " ")],
)
def test_usage_errors_stop_it_before_anything_runs(tmp_path: Path, args: tuple[str, ...]) -> None:
    r = _script("--smoke", *args, tmp=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("gpu.sh: ")
    assert not (tmp_path / "gpu-bench.json").exists()


def test_it_never_installs_torch_transformers_or_cuda_wheels(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    r = _script("--smoke", "--wheels", str(wheels), tmp=tmp_path)
    assert r.returncode == 2 and "never installed" in r.stderr


def test_the_script_is_valid_bash_and_says_how_to_use_it(tmp_path: Path) -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    r = _script("--help", tmp=tmp_path)
    assert r.returncode == 0 and "--prepare" in r.stdout and 'carry=[".bench/gpu-wheels"]' in r.stdout


# ---- what the script relies on in the bench --------------------------------------------------------------


def test_the_1_7b_preset_is_smollm2_1_7b_shaped() -> None:
    # Built on the meta device: the shape and the parameter count, without 7 GB of float32.
    config = transformers.LlamaConfig(**PRESETS["1.7b"])
    with torch.device("meta"):
        model: Any = transformers.LlamaForCausalLM(config)
    s = llama.shape_of(model)
    assert (s.n_layers, s.hidden, s.n_heads, s.n_kv_heads, s.head_dim, s.vocab) == (
        24,
        2048,
        32,
        32,
        64,
        49152,
    )
    assert llama.unsupported_reason(model) is None
    params = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    assert 1.70e9 < params < 1.72e9
    assert {"1b", "1.7b", "135m", "tiny"} <= set(PRESETS)


def test_max_tokens_caps_the_outputs_and_keeps_the_prompts() -> None:
    loaded = random_model("tiny", "cpu", "float32")
    full = bench_paths.workload(loaded, 16, 0, random_ids=True)
    capped = bench_paths.workload(loaded, 16, 0, random_ids=True, max_tokens=20)
    assert [r.prompt_ids for r in capped] == [r.prompt_ids for r in full]
    assert [r.out_len for r in capped] == [min(20, r.out_len) for r in full]
    assert max(r.out_len for r in full) > 20
    with pytest.raises(ValueError):
        bench_paths.workload(loaded, 2, 0, random_ids=True, max_tokens=0)


def test_the_padded_loop_speaks_both_cache_keywords() -> None:
    class Old:  # transformers before 5.24, as a GPU image may carry it
        def forward(self, input_ids: Any = None, past_key_values: Any = None, **kw: Any) -> None: ...

    class New:
        def forward(self, input_ids: Any = None, cache: Any = None, **kw: Any) -> None: ...

    assert bench_paths._cache_kw(Old()) == "past_key_values"
    assert bench_paths._cache_kw(New()) == "cache"
    assert bench_paths._cache_kw(random_model("tiny", "cpu", "float32").model) in ("cache", "past_key_values")
