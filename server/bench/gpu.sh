#!/usr/bin/env bash
# server/bench/gpu.sh: `tokenwire bench` on a GPU machine, ready for the first one (issue 26, item 6).
#
# The engine against transformers' padded decode loop and transformers' continuous batching, at the shapes
# of SmolLM2-135M and SmolLM2-1.7B (random weights: nothing to download), 32, 64 and 256 concurrent streams,
# cheapest runs first, all of it in ONE JSON file, in under 8 minutes on an H200.
#
#   Here (a machine that reaches PyPI), once: the small wheels the bench imports that a GPU image lacks
#   (structlog, PyJWT, websockets: about 0.3 MB), at this checkout's versions, for CPython 3.12 on x86-64:
#       server/bench/gpu.sh --prepare [DIR]        # DIR defaults to .bench/gpu-wheels (ignored by git)
#   There (no network; torch and transformers preinstalled: this script never installs them), repo root:
#       server/bench/gpu.sh [OUT.json]             # default $OUT/gpu.json when $OUT is set, else ./gpu-bench.json
#   With this workplace's device tool, from this checkout:
#       run(command="bash server/bench/gpu.sh", carry=[".bench/gpu-wheels"], timeout_s=540)
#   On a CPU, in seconds: the same script end to end on the toy preset (tests/bench/test_gpu_script.py):
#       server/bench/gpu.sh --smoke [OUT.json]
#   On a CPU that reaches PyPI, about a minute: the smoke run, transformers' continuous batching included,
#   against the GPU image's own transformers, huggingface_hub, tokenizers and safetensors (GPU_IMAGE_PINS
#   below, installed once into .bench/gpu-image-site, which shadows the venv's), so an API that differs
#   between those and this project's pins fails here, not in the GPU lease (`make bench-gpu-smoke`):
#       server/bench/gpu.sh --image-smoke [OUT.json]
#
# Options:
#   --runs "PRESET:N[:LIMIT_S] ..."  the runs, in order (default: the matrix below; --smoke: tiny:2 tiny:4)
#   --paths P,Q,...    bench paths (default padded_loop,hf_cb,engine; --smoke: padded_loop,engine, since on
#                      a CPU transformers' continuous batching takes 90% of the RAM for its paged cache)
#   --device DEV       default cuda (--smoke: cpu)
#   --budget S         seconds for the whole script (default 450; --smoke: 120): a run's limit is cut to
#                      what is left, and no run starts with less than 45 s (--smoke: 5 s) left
#   --wheels DIR       wheels to install first (default .bench/gpu-wheels when it holds any; --smoke: none)
#   -- ARGS            passed to every `tokenwire bench` (e.g. -- --profile)
#   PYTHON=...         the interpreter (default .venv/bin/python when there is one, else python3)
#
# Each run is `python -m server.cli bench --device DEV --random-weights PRESET --requests N --paths ...
# --json FILE` under `timeout`. A run that fails or times out is recorded (exit status, the tail of its
# stderr, and the rows its table printed before it stopped) and the next run starts; a path that made a
# run time out is left out of the runs after it. The JSON is rewritten after every run, so a script killed
# from outside still leaves the runs before. Exit status: 0 when every run passed, 1 otherwise, 2 on a
# usage error.

set -uo pipefail

GPU_RUNS="135m:32:90 135m:64:90 1.7b:32:100 1.7b:64:100 135m:256:120 1.7b:256:150"
SMOKE_RUNS="tiny:2 tiny:4"
DEFAULT_LIMIT=120 # seconds, for a run given without one
PROJECT_WHEELS="structlog PyJWT websockets" # what the bench imports beyond the GPU image's packages
# What the GPU image reports for the packages the bench reads models through (pip list there, 2026-11:
# Python 3.12.3, torch 2.11.0+cu130). torch is not among them: a CPU torch 2.11 from PyPI is not a wheel
# this machine can take (its CUDA build is several GB), so --image-smoke keeps the venv's torch.
GPU_IMAGE_PINS="transformers==5.17.0 huggingface_hub==1.33.0 tokenizers==0.23.2 safetensors==0.8.0"
# What those import that the venv's newer versions do not (--no-deps keeps the venv's numpy, yaml, ...).
GPU_IMAGE_EXTRA="httpx httpcore anyio certifi idna"

die() {
	echo "gpu.sh: $*" >&2
	exit 2
}

orig=$PWD
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd) || die "cannot find the repository"
cd "$repo" || die "cannot enter $repo"
if [[ -z ${PYTHON:-} ]]; then
	if [[ -x .venv/bin/python ]]; then PYTHON=$repo/.venv/bin/python; else PYTHON=python3; fi
fi

mode=gpu out="" runs="" paths="" device="" budget="" wheels="" wheels_given=0
extra=()
while (($#)); do
	case $1 in
	--prepare)
		mode=prepare
		if [[ -n ${2:-} && $2 != -* ]]; then
			wheels=$2
			shift
		fi
		;;
	--smoke) mode=smoke ;;
	--image-smoke) mode=image ;;
	--runs) runs=${2:?--runs needs a value} && shift ;;
	--paths) paths=${2:?--paths needs a value} && shift ;;
	--device) device=${2:?--device needs a value} && shift ;;
	--budget) budget=${2:?--budget needs a value} && shift ;;
	--wheels) wheels=${2:?--wheels needs a value} && wheels_given=1 && shift ;;
	-h | --help)
		sed -n '2,/^$/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"
		exit 0
		;;
	--)
		shift
		extra=("$@")
		break
		;;
	-*) die "unknown option $1 (see --help)" ;;
	*) out=$1 ;;
	esac
	shift
done

# ---- --prepare: here, with PyPI -------------------------------------------------------------------------

if [[ -n $wheels && $wheels != /* ]]; then wheels=$orig/$wheels; fi # as given, from where it was given

if [[ $mode == prepare ]]; then
	wheels=${wheels:-$repo/.bench/gpu-wheels}
	mkdir -p "$wheels" || die "cannot make $wheels"
	# shellcheck disable=SC2086 # the names are words
	specs=$("$PYTHON" -c 'import sys; from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in sys.argv[1:]))' $PROJECT_WHEELS) ||
		die "$PYTHON lacks $PROJECT_WHEELS (install the project first, or set PYTHON)"
	rm -f "$wheels"/*.whl # one version of each: two would stop the install there
	platforms=()
	for p in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
		manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
		platforms+=(--platform "${p}_x86_64")
	done
	# shellcheck disable=SC2086
	"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
		--python-version "${GPU_PYTHON_VERSION:-3.12}" "${platforms[@]}" -d "$wheels" $specs ||
		{
			echo "gpu.sh: pip download failed ($specs)" >&2
			exit 1
		}
	echo "gpu.sh: $(find "$wheels" -name '*.whl' | wc -l) wheels in $wheels ($specs), $(du -sh "$wheels" | cut -f1)"
	echo "device tool: run(command=\"bash server/bench/gpu.sh\", carry=[\"${wheels#"$repo"/}\"], timeout_s=540)"
	exit 0
fi

# ---- --image-smoke: here, with PyPI: the smoke run on the GPU image's versions --------------------------

if [[ $mode == image ]]; then
	site=$repo/.bench/gpu-image-site
	pins="$GPU_IMAGE_PINS $GPU_IMAGE_EXTRA"
	if [[ $(cat "$site/.pins" 2>/dev/null) != "$pins" ]]; then
		rm -rf "$site"
		# shellcheck disable=SC2086 # the pins are words
		"$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps --target "$site" $pins || {
			echo "gpu.sh: installing $pins into $site failed" >&2
			exit 1
		}
		echo "$pins" >"$site/.pins"
	fi
	want=$(sed -n 's/.*transformers==\([^ ]*\).*/\1/p' <<<"$GPU_IMAGE_PINS")
	got=$(PYTHONPATH=$site "$PYTHON" -c 'import transformers; print(transformers.__version__)') ||
		die "transformers from $site does not import"
	[[ $got == "$want" ]] || die "$site gives transformers $got, not $want"
	out=${out:-$repo/.bench/gpu-image-smoke.json}
	[[ $out == /* ]] || out=$orig/$out
	echo "gpu.sh: the smoke run with transformers $got and the rest of: $GPU_IMAGE_PINS"
	# transformers' continuous batching too: it is the path most likely to differ between versions. One
	# run of 4: on a CPU its paged cache takes most of the RAM for about a minute.
	PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} exec bash "${BASH_SOURCE[0]}" --smoke --runs "${runs:-tiny:4:240}" \
		--paths "${paths:-padded_loop,hf_cb,engine}" --budget "${budget:-300}" "$out" -- ${extra[@]+"${extra[@]}"}
fi

# ---- the runs ----------------------------------------------------------------------------------------------

if [[ $mode == smoke ]]; then
	runs=${runs:-$SMOKE_RUNS} paths=${paths:-padded_loop,engine} device=${device:-cpu}
	budget=${budget:-120} min_run=5
	# One thread: a toy model gains nothing from more, and on a shared machine OpenMP's spinning threads
	# can turn a millisecond step into tens of milliseconds.
	export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
else
	runs=${runs:-$GPU_RUNS} paths=${paths:-padded_loop,hf_cb,engine} device=${device:-cuda}
	budget=${budget:-450} min_run=45
	if [[ $wheels_given == 0 ]]; then wheels=$repo/.bench/gpu-wheels; fi
fi
runs=${runs//,/ }
[[ $budget =~ ^[0-9]+$ ]] || die "--budget wants whole seconds, got $budget"
for spec in $runs; do
	[[ $spec =~ ^[^:]+:[0-9]+(:[0-9]+)?$ ]] || die "--runs: $spec is not PRESET:N[:LIMIT_S]"
done
[[ -n ${runs// /} ]] || die "--runs: no runs"
if [[ -z $out ]]; then
	if [[ -n ${OUT:-} ]]; then out=$OUT/gpu.json; else out=gpu-bench.json; fi
fi
[[ $out == /* ]] || out=$orig/$out
mkdir -p "$(dirname "$out")" || die "cannot make the folder of $out"

work=$(mktemp -d "${TMPDIR:-/tmp}/tokenwire-gpu.XXXXXX") || die "mktemp failed"
trap 'rm -rf "$work"' EXIT

site=""
if [[ -n $wheels ]] && compgen -G "$wheels/*.whl" >/dev/null; then
	for w in "$wheels"/*.whl; do
		case ${w##*/} in
		torch-* | torchvision-* | torchaudio-* | transformers-* | triton-* | nvidia_* | nvidia-*)
			die "$w: torch, transformers and CUDA wheels are never installed here (the machine's own are used)"
			;;
		esac
	done
	site=$work/site
	"$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
		--target "$site" "$wheels"/*.whl || {
		echo "gpu.sh: installing $wheels/*.whl failed" >&2
		exit 1
	}
elif [[ $wheels_given == 1 ]]; then
	die "--wheels $wheels: no wheels there"
fi
export PYTHONPATH="$repo${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 # the table's rows reach the log as each path ends (read back after a timeout)
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false

now() { echo "${EPOCHREALTIME:-$(date +%s.%N)}"; }

# The recorder: machine facts, one entry per run, the summary. Python, so the JSON stays JSON; it imports
# torch only for the facts.
rec=$work/record.py
cat >"$rec" <<'PY'
import importlib
import importlib.metadata as md
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

PATHS = ("padded_loop", "static", "hf_cb", "engine", "engine_poisson")  # the order the bench runs them
NAMES = "|".join(PATHS)
ROW = re.compile(
    rf"^({NAMES})\s+(\S+) tok/s\s+TTFT p50\s+(\S+) p99\s+(\S+) ms\s+ITL p50\s+(\S+) p99\s+(\S+) ms\s*(.*)$"
)
FIELDS = ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
DISTS = ("torch", "transformers", "huggingface_hub", "safetensors", "numpy", "structlog", "PyJWT",
         "websockets", "msgpack", "rich", "h11")


def save(path, doc):
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)


def tail(path, n):
    try:
        return Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def number(text):
    try:
        return float(text)
    except ValueError:
        return None


def rows(stdout):
    """The rows of the bench's table: what a run that never wrote its JSON still measured."""
    found = {}
    for line in stdout.splitlines():
        m = ROW.match(line)
        if m:
            found[m[1]] = {**{k: number(v) for k, v in zip(FIELDS, m.groups()[1:6], strict=True)}, "note": m[7]}
    return found


def facts(device):
    f = {"python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
         "cpu_count": os.cpu_count(), "nvidia_smi": None}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = [smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"]
        try:
            r = subprocess.run(q, capture_output=True, text=True, timeout=30)
            f["nvidia_smi"] = [
                dict(zip(("name", "memory_total_mib", "driver"), (x.strip() for x in line.split(",")), strict=False))
                for line in r.stdout.strip().splitlines()
            ] if r.returncode == 0 else {"error": (r.stderr or r.stdout).strip()[-500:]}
        except (OSError, subprocess.SubprocessError) as e:
            f["nvidia_smi"] = {"error": repr(e)}
    versions = {}
    for d in DISTS:
        try:
            versions[d] = md.version(d)
        except md.PackageNotFoundError:
            versions[d] = None
    f["versions"] = versions
    missing, loaded = [], set()
    for mod in ("torch", "transformers", "numpy", "structlog", "jwt", "websockets", "msgpack",
                "server.cli", "server.bench.main"):
        try:
            m = importlib.import_module(mod)
            loaded.add(mod)
            if mod in ("torch", "transformers", "structlog", "websockets"):
                f.setdefault("loaded_from", {})[mod] = os.path.dirname(getattr(m, "__file__", "") or "")
        except Exception as e:  # any failure to import is the answer
            missing.append(f"{mod} ({type(e).__name__}: {e})")
    if "torch" in loaded:
        import torch

        f["torch"] = torch.__version__
        f["torch_cuda"] = torch.version.cuda
        f["cuda_available"] = torch.cuda.is_available()
        if device.startswith("cuda") and torch.cuda.is_available():
            p = torch.cuda.get_device_properties(torch.device(device))
            f["gpu"] = {"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                        "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, timeout=30)
        if head.returncode == 0:
            f["commit"] = head.stdout.strip()
            f["uncommitted_files"] = len(dirty.stdout.splitlines()) if dirty.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        pass
    return f, missing


def start(out, mode, device, paths, budget, runs, wheels, extra):
    f, missing = facts(device)
    doc = {
        "tool": "server/bench/gpu.sh", "mode": mode, "device": device, "paths": paths.split(","),
        "runs_planned": runs.split(), "budget_s": int(budget), "bench_args": extra.split("\x1f") if extra else [],
        "wheels": [],
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": f, "runs": [],
        "status": "running",
    }
    for w in sorted(Path(wheels).glob("*.whl")) if wheels else []:
        dist, version = w.name.split("-")[:2]
        try:
            found = md.version(dist)
        except md.PackageNotFoundError:
            found = None
            missing.append(f"{w.name} (installed, but not on the path)")
        doc["wheels"].append({"wheel": w.name, "version": version, "found": found})
    error = None
    if missing:
        error = "cannot import " + "; ".join(missing)
        if any(m.split()[0] in ("structlog", "jwt", "websockets") for m in missing):
            error += " (the project's wheels: server/bench/gpu.sh --prepare where PyPI is, then carry them)"
    elif device.startswith("cuda") and not f.get("cuda_available"):
        error = f"--device {device}, but torch {f.get('torch')} sees no CUDA device"
    if error:
        doc["status"], doc["error"] = "error", error
    save(out, doc)
    print(f"machine: {json.dumps(f, separators=(',', ':'))}")
    if error:
        print(f"gpu.sh: {error}", file=sys.stderr)
        sys.exit(1)


def run(out, name, preset, requests, limit, status, rc, t0, t1, bench_json, stdout, stderr, paths, command):
    doc = json.loads(Path(out).read_text())
    entry = {"name": name, "preset": preset, "requests": int(requests), "paths": [p for p in paths.split(",") if p],
             "limit_s": int(limit), "status": status, "rc": None if rc == "" else int(rc),
             "wall_s": round(float(t1) - float(t0), 1) if t0 and t1 else 0.0}
    entry["reason" if status == "skipped" else "command"] = command
    drop = None
    if status != "skipped":
        bench = None
        if Path(bench_json).is_file():
            try:
                bench = json.loads(Path(bench_json).read_text())
            except ValueError:
                bench = None
        text = tail(stdout, 1 << 20)
        table = rows(text)
        if bench is not None:
            entry["tok_s"] = {p: (bench.get(p) or {}).get("tok_s") for p in entry["paths"]}
            entry["failed_paths"] = bench.get("failed", [])
            entry["bench"] = bench
        else:  # no JSON: what its table printed before it stopped
            entry["tok_s"] = {p: (table.get(p) or {}).get("tok_s") for p in entry["paths"]}
            entry["partial"] = table
        entry["stdout_tail"] = text[-6000:]
        entry["stderr_tail"] = tail(stderr, 4000 if status != "ok" else 1500)
        if status == "timeout":
            todo = [p for p in PATHS if p in entry["paths"] and p not in table]
            if bench is not None:  # it wrote its JSON, then did not exit
                entry["timed_out_in"] = "its exit, after writing its JSON"
            elif not re.search(r"^tokenwire bench: ", text, re.M):  # the header comes once the model is built
                entry["timed_out_in"] = "start-up (imports, the model)"
            elif todo:  # the path it was in when the time ran out: the runs after this one go without it
                drop = todo[0]
                entry["timed_out_in"] = drop
            else:
                entry["timed_out_in"] = "after the paths (floor, roofline, late arrival)"
    doc["runs"].append(entry)
    save(out, doc)
    if drop:
        print(drop)


def finish(out, t0, t1):
    doc = json.loads(Path(out).read_text())
    doc["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    doc["wall_s"] = round(float(t1) - float(t0), 1)
    bad = [r["name"] for r in doc["runs"] if r["status"] != "ok"]
    doc["status"] = "failed" if bad else "ok"
    if bad:
        doc["not_ok"] = bad
    summary = []
    cols = [p for p in PATHS if any(p in r["paths"] for r in doc["runs"])]
    print("useful tokens/s:")
    print(f"{'run':14s} {'status':8s}" + "".join(f"{p:>13s}" for p in cols) + f"{'wall':>10s}")
    for r in doc["runs"]:
        t = r.get("tok_s") or {}
        cells = "".join(f"{t[p]:>13.1f}" if t.get(p) else f"{'-':>13s}" for p in cols)
        print(f"{r['name']:14s} {r['status']:8s}{cells}{r['wall_s']:>8.1f} s")
        line = {"run": r["name"], "status": r["status"], "tok_s": t}
        if t.get("engine"):
            line["engine_over"] = {p: round(t["engine"] / t[p], 2) for p in cols if p != "engine" and t.get(p)}
        summary.append(line)
    doc["summary"] = summary
    save(out, doc)
    print(f"wrote {out} ({len(doc['runs'])} runs, {doc['wall_s']} s)")


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    {"start": start, "run": run, "finish": finish}[cmd](*args)
PY

t_start=$(now)
extra_joined=$(
	IFS=$'\x1f'
	echo "${extra[*]}"
)
echo "gpu.sh: $mode on $device; runs: $runs; paths: $paths; budget ${budget} s; writing $out"
"$PYTHON" "$rec" start "$out" "$mode" "$device" "$paths" "$budget" "$runs" "${site:+$wheels}" "$extra_joined" ||
	exit 1

failed=0
i=0
for spec in $runs; do
	i=$((i + 1))
	IFS=: read -r preset n limit <<<"$spec"
	limit=${limit:-$DEFAULT_LIMIT}
	name="$preset x$n"
	left=$((budget - SECONDS))
	if [[ -z $paths ]]; then
		reason="no path left"
	elif ((left < min_run)); then
		reason="${left} s of the ${budget} s budget left"
	else
		reason=""
	fi
	if [[ -n $reason ]]; then
		echo "== $name: skipped ($reason)"
		"$PYTHON" "$rec" run "$out" "$name" "$preset" "$n" "$limit" skipped "" "" "" "" "" "" "$paths" "$reason"
		failed=1
		continue
	fi
	((limit > left)) && limit=$left
	cmd=("$PYTHON" -m server.cli bench --device "$device" --random-weights "$preset" --requests "$n"
		--paths "$paths" --json "$work/run$i.json" ${extra[@]+"${extra[@]}"})
	shown="tokenwire bench --device $device --random-weights $preset --requests $n --paths $paths --json FILE"
	shown+="${extra[*]:+ ${extra[*]}}"
	echo "== $name: $shown (limit ${limit} s)"
	t0=$(now)
	timeout -k 10 "$limit" "${cmd[@]}" 2>"$work/run$i.err" | tee "$work/run$i.out"
	rc=${PIPESTATUS[0]}
	t1=$(now)
	case $rc in
	0) status=ok ;;
	124 | 137) status=timeout ;;
	*) status=failed ;;
	esac
	if [[ $status != ok ]]; then
		failed=1
		echo "== $name: $status (exit $rc); the end of its stderr:"
		tail -n 15 "$work/run$i.err"
	fi
	drop=$("$PYTHON" "$rec" run "$out" "$name" "$preset" "$n" "$limit" "$status" "$rc" "$t0" "$t1" \
		"$work/run$i.json" "$work/run$i.out" "$work/run$i.err" "$paths" "$shown") || failed=1
	if [[ -n $drop ]]; then
		paths=$(tr ',' '\n' <<<"$paths" | grep -vx "$drop" | paste -sd, -)
		echo "== $drop timed out: the runs after this one go without it (paths now: ${paths:-none})"
	fi
done

"$PYTHON" "$rec" finish "$out" "$t_start" "$(now)" || failed=1
exit "$failed"
