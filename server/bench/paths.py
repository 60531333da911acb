"""The bench's paths: the same workload through the engine and through transformers' own ways to serve it.

Workload (ARCHITECTURE.md, "Numbers that matter"): ``--requests`` chat requests with varied prompts,
each with its own output length drawn from 16-128, EOS ignored and greedy decoding, so every path does
the same useful work. Useful tokens/s counts each request's own output length only (a padded row
running past its length is waste).
TTFT is measured from a request's arrival; inter-token latency (ITL) is the gap between a request's
consecutive tokens as its client would see them.

Every path gets the same warm-up first, untimed: ``warmup_requests`` (two of the requests, 4 tokens each)
through its own machinery, so first-use costs (oneDNN primitives, caches, allocator) count for none.
A path that fails, or produces fewer tokens than asked, raises: the bench reports it and fails.

Device-generic: every tensor is made on ``loaded.device`` (or on the CPU and moved there), every timestamp
is taken after a CUDA synchronisation, and each path hands its memory back when it ends (``_release``), so
the next path on a GPU (the engine sizes its KV cache from the free memory) finds what this one found.
The transformers calls work with the version the project pins and with the older 5.x that a GPU image may
carry (``cache=`` since 5.24, ``past_key_values=`` before).
"""

from __future__ import annotations

import gc
import inspect
import itertools
import queue
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from server.engine.api import GenerationRequest, SamplingParams, StepOutput
from server.engine.engine import BatchingEngine
from server.engine.model import LoadedModel
from server.engine.profile import StepProfile, StepRecord
from server.engine.threads import in_own_thread

PATHS = ("padded_loop", "static", "hf_cb", "engine", "engine_poisson")
OUT_MIN, OUT_MAX = 16, 128
WARMUP_TOKENS = 4
STATIC_BATCH = 8
POISSON_LOAD = 0.7

_TOPIC_LIST = (
    "the history of the printing press; how vaccines train the immune system; why the sky is blue; "
    "the rules of chess for a beginner; how to bake sourdough bread; what a hash table is; the water cycle; "
    "how WebSockets differ from HTTP polling; the causes of the French Revolution; how solar panels make "
    "electricity; what photosynthesis does; how to learn a new language as an adult; the difference between "
    "weather and climate; how a compiler turns code into a program; the life cycle of a star; good habits "
    "for a healthy sleep"
)
TOPICS = _TOPIC_LIST.split("; ")
DETAILS = [
    "Keep it simple, I am new to this.",
    "Please give a short example.",
    "I have read a little about it before, but the details confuse me.",
    "My friend told me a story about it and I want to check whether it is true.",
    "Explain it as you would to a curious twelve-year-old, step by step, and mention one common mistake.",
    "I am preparing a short talk for my colleagues next week and I need a clear outline with the key "
    "points, a memorable example and a one-sentence summary at the end.",
]


@dataclass(slots=True)
class BenchRequest:
    key: str
    prompt_ids: list[int]
    out_len: int


@dataclass(slots=True)
class PathResult:
    tok_s: float | None = None
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    seconds: float | None = None
    useful_tokens: int = 0
    note: str = ""


@dataclass(slots=True)
class Timings:
    """Arrival and token times (perf_counter seconds) per request."""

    arrival: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, list[float]] = field(default_factory=dict)

    def add(self, key: str, t: float, n: int = 1) -> None:
        times = self.tokens.setdefault(key, [])
        if times and n > 1:
            # n tokens delivered together (held back by the detokenizer): spread the gap over them.
            prev = times[-1]
            times.extend(prev + (t - prev) * (i + 1) / n for i in range(n))
        else:
            times.extend([t] * n)

    def result(self, useful: int, seconds: float, note: str = "") -> PathResult:
        ttft = [ts[0] - self.arrival[k] for k, ts in self.tokens.items() if ts]
        itl = [b - a for ts in self.tokens.values() for a, b in itertools.pairwise(ts)]
        return PathResult(
            tok_s=round(useful / seconds, 1) if seconds > 0 else None,
            ttft_p50_ms=_pct(ttft, 50),
            ttft_p99_ms=_pct(ttft, 99),
            itl_p50_ms=_pct(itl, 50),
            itl_p99_ms=_pct(itl, 99),
            seconds=round(seconds, 2),
            useful_tokens=useful,
            note=note,
        )


def _pct(xs: Sequence[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return round((s[lo] + (s[hi] - s[lo]) * (k - lo)) * 1000, 1)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)  # that device's stream, not the current one (--device cuda:1)


def _release(device: str) -> None:
    """Give a path's GPU memory back when it ends: PyTorch's allocator would otherwise keep it reserved,
    and the next path (the engine sizes its KV cache from ``torch.cuda.mem_get_info``) would find less
    free memory than this one did. Nothing to do on a CPU."""
    if device.startswith("cuda"):
        gc.collect()
        torch.cuda.empty_cache()


# ---- workload ------------------------------------------------------------------------------------


def workload(
    loaded: LoadedModel, n: int, seed: int, *, random_ids: bool = False, max_tokens: int | None = None
) -> list[BenchRequest]:
    """``n`` requests; ``max_tokens`` caps each output length (drawn from OUT_MIN-OUT_MAX as without a
    cap, so the prompts and the uncapped lengths stay those of the full workload)."""
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    cap = OUT_MAX if max_tokens is None else max_tokens
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        content = f"Tell me about {TOPICS[i % len(TOPICS)]}. " + " ".join(
            rng.sample(DETAILS, rng.randint(0, 3))
        )
        if random_ids:  # random weights have no tokenizer: random ids of chat-like lengths
            ids = [rng.randrange(3, loaded.model.config.vocab_size) for _ in range(rng.randint(30, 150))]
        else:
            ids = loaded.encode_chat([{"role": "user", "content": content}])
        reqs.append(BenchRequest(f"r{i}", ids, min(cap, rng.randint(OUT_MIN, OUT_MAX))))
    return reqs


def warmup_requests(reqs: Sequence[BenchRequest]) -> list[BenchRequest]:
    """The warm-up every path runs first: two of the requests, a few tokens each."""
    return [BenchRequest(f"warm-{r.key}", r.prompt_ids, WARMUP_TOKENS) for r in reqs[:2]]


def _pad_id(loaded: LoadedModel) -> int:
    pad = getattr(loaded.model.config, "pad_token_id", None)
    return int(pad) if isinstance(pad, int) else 0


def _left_pad(reqs: Sequence[BenchRequest], pad: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r.prompt_ids) for r in reqs)
    ids = torch.full((len(reqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(reqs), width), dtype=torch.long)
    for i, r in enumerate(reqs):
        ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids) :] = 1
    return ids.to(device), mask.to(device)


# ---- (a) padded_loop: one plain decode loop over all requests, padded to the longest ---------------


PADDED_CACHES = ("dynamic", "static")


def run_padded_loop(loaded: LoadedModel, reqs: Sequence[BenchRequest]) -> PathResult:
    """The plain loop with each of transformers' caches, warmed up alike; the faster one is the
    reference (the note gives both), so no ratio is flattered by the weaker cache."""
    try:
        runs = {}
        for kind in PADDED_CACHES:
            _padded_loop(loaded, warmup_requests(reqs), kind)
            runs[kind] = _padded_loop(loaded, reqs, kind)
        best = max(runs, key=lambda k: runs[k].tok_s or 0.0)
        res = runs[best]
        both = ", ".join(f"{k} {r.tok_s or 0:.1f}" for k, r in runs.items())
        res.note = f"{best} cache ({both} tok/s)"
        return res
    finally:
        _release(loaded.device)


def _cache_kw(model: Any) -> str:
    """The name under which this transformers' forward takes and returns the KV cache: ``cache`` since
    5.24 (the version this project pins), ``past_key_values`` before (what a GPU image may carry)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def _padded_loop(
    loaded: LoadedModel,
    reqs: Sequence[BenchRequest],
    cache_kind: str = "dynamic",
    tokens: dict[str, list[int]] | None = None,
) -> PathResult:
    """Greedy decoding of every request at once, left-padded to the longest prompt, for as many steps as
    the longest reply. ``cache_kind``: ``dynamic`` (grows by concatenation: every step copies the whole
    cache) or ``static`` (allocated once at its final length: no copy, but attention spans all of it).
    ``tokens``: filled with each request's generated ids (the tests compare them with a plain loop)."""
    from transformers import DynamicCache, StaticCache

    model, dev = loaded.model, loaded.device
    tm = Timings()
    ids, mask = _left_pad(reqs, _pad_id(loaded), dev)
    steps = max(r.out_len for r in reqs)
    t0 = time.perf_counter()
    for r in reqs:
        tm.arrival[r.key] = t0
    kw = _cache_kw(model)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    cache: Any
    if cache_kind == "static":
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + steps)
        # The mask at its final length: the positions not generated yet are hidden by causality.
        mask = torch.cat([mask, torch.ones_like(mask[:, :1]).expand(-1, steps)], dim=1)
    elif cache_kind == "dynamic":
        cache = DynamicCache(config=model.config)
    else:
        raise ValueError(f"cache_kind: dynamic or static, not {cache_kind!r}")
    out = model(
        input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1, **{kw: cache}
    )
    for step in range(steps):
        nxt = out.logits[:, -1].argmax(-1)
        _sync(dev)
        now = time.perf_counter()
        for i, r in enumerate(reqs):
            if step < r.out_len:
                tm.add(r.key, now)
                if tokens is not None:
                    tokens.setdefault(r.key, []).append(int(nxt[i]))
        if step == steps - 1:
            break
        if cache_kind == "dynamic":
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        pos = pos[:, -1:] + 1
        cache = getattr(out, kw)
        out = model(
            input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, use_cache=True, **{kw: cache}
        )
    seconds = time.perf_counter() - t0
    return tm.result(sum(r.out_len for r in reqs), seconds)


# ---- (b) model.generate on static padded batches --------------------------------------------------


class _StepTimes:
    """A generate() streamer that only records when each step's tokens come out."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True  # the first call carries the prompt
            return
        _sync(self.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_static(loaded: LoadedModel, reqs: Sequence[BenchRequest], batch: int = STATIC_BATCH) -> PathResult:
    try:
        _static(loaded, warmup_requests(reqs), batch)
        return _static(loaded, reqs, batch)
    finally:
        _release(loaded.device)


@torch.inference_mode()
def _static(loaded: LoadedModel, reqs: Sequence[BenchRequest], batch: int) -> PathResult:
    from transformers import GenerationConfig

    model, dev = loaded.model, loaded.device
    tm = Timings()
    t0 = time.perf_counter()
    for r in reqs:
        tm.arrival[r.key] = t0
    for lo in range(0, len(reqs), batch):
        group = reqs[lo : lo + batch]
        ids, mask = _left_pad(group, _pad_id(loaded), dev)
        n = max(r.out_len for r in group)
        # min_new_tokens = max_new_tokens: EOS cannot end a row early, as in the other paths.
        cfg = GenerationConfig(  # type: ignore[no-untyped-call]
            do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=_pad_id(loaded)
        )
        streamer = _StepTimes(dev)
        model.generate(ids, attention_mask=mask, generation_config=cfg, streamer=streamer)
        for r in group:
            for t in streamer.times[: r.out_len]:
                tm.add(r.key, t)
    return tm.result(sum(r.out_len for r in reqs), time.perf_counter() - t0)


# ---- (c) transformers' continuous batching --------------------------------------------------------


def run_hf_cb(loaded: LoadedModel, reqs: Sequence[BenchRequest]) -> PathResult:
    """transformers' own continuous batching, as it sizes itself: on a GPU its paged cache takes 90% of the
    free memory (given back when it stops, and again by ``_release``)."""
    try:
        return _hf_cb(loaded, reqs)
    finally:
        _release(loaded.device)


@torch.inference_mode()
def _hf_cb(loaded: LoadedModel, reqs: Sequence[BenchRequest]) -> PathResult:
    from transformers import GenerationConfig

    model = loaded.model
    cfg = GenerationConfig(  # type: ignore[no-untyped-call]
        do_sample=False, max_new_tokens=OUT_MAX, eos_token_id=-1, pad_token_id=_pad_id(loaded)
    )
    manager = model.init_continuous_batching(generation_config=cfg)
    manager.start()
    try:
        # The same warm-up as every path (the manager also sizes its paged cache on the first request).
        warm = warmup_requests(reqs)
        for r in warm:
            manager.add_request(r.prompt_ids, request_id=r.key, max_new_tokens=r.out_len, eos_token_id=-1)
        _collect(manager, {r.key for r in warm})
        tm = Timings()
        t0 = time.perf_counter()
        for r in reqs:
            tm.arrival[r.key] = time.perf_counter()
            manager.add_request(
                r.prompt_ids,
                request_id=r.key,
                max_new_tokens=r.out_len,
                record_timestamps=True,
                eos_token_id=-1,
            )
        done = _collect(manager, {r.key for r in reqs})
        seconds = max(max(o.timestamps or [0.0]) for o in done.values()) - t0
        useful = 0
        for key, o in done.items():
            tm.tokens[key] = list(o.timestamps or [])
            useful += len(o.generated_tokens)
        if useful != sum(r.out_len for r in reqs):
            raise RuntimeError(f"produced {useful} of {sum(r.out_len for r in reqs)} tokens")
        return tm.result(useful, seconds)
    finally:
        manager.stop(block=True, timeout=10)


def _collect(manager: Any, keys: set[str]) -> dict[str, Any]:
    done: dict[str, Any] = {}
    deadline = time.monotonic() + 1800
    while len(done) < len(keys):
        if time.monotonic() > deadline or not manager.is_running():
            raise RuntimeError(f"transformers continuous batching stopped with {len(keys) - len(done)} left")
        out = manager.get_result(timeout=1)
        if out is not None and out.is_finished():
            if out.error:
                raise RuntimeError(f"transformers continuous batching failed: {out.error}")
            done[out.request_id] = out
    return done


# ---- (d, e) the tokenwire engine -----------------------------------------------------------------


def run_engine(
    loaded: LoadedModel,
    reqs: Sequence[BenchRequest],
    *,
    arrivals: Sequence[float] | None = None,
    engine_kw: dict[str, Any] | None = None,
    step_log: list[StepRecord] | None = None,
) -> PathResult:
    """All requests at once (``arrivals`` None), or each at its offset in seconds from the start.
    ``step_log`` receives every timed step's phase profile."""
    try:
        return _engine(loaded, reqs, arrivals=arrivals, engine_kw=engine_kw, step_log=step_log)
    finally:
        _release(loaded.device)  # the engine (and its KV cache) is gone by now: its memory goes back


def _engine(
    loaded: LoadedModel,
    reqs: Sequence[BenchRequest],
    *,
    arrivals: Sequence[float] | None,
    engine_kw: dict[str, Any] | None,
    step_log: list[StepRecord] | None,
) -> PathResult:
    # Built (weights packed) in a thread that ends: the engine's thread must be the only one holding an
    # OpenMP pool while it runs (server/engine/threads.py).
    engine = in_own_thread(lambda: BatchingEngine(loaded, **(engine_kw or {})))
    steps: queue.Queue[tuple[float, list[StepOutput]]] = queue.Queue()
    engine.start(lambda outs: steps.put((time.perf_counter(), outs)))
    try:
        _engine_warmup(engine, steps, reqs)
        # A few microseconds a step: laps at phase boundaries, on CPU only (profile.py says why).
        engine.profile = StepProfile(phases=torch.device(loaded.device).type == "cpu")
        tm = Timings()
        t0 = time.perf_counter()
        for i, r in enumerate(reqs):
            if arrivals is not None:
                time.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            tm.arrival[r.key] = time.perf_counter()
            engine.submit(_engine_request(r))
        pending = {r.key for r in reqs}
        useful = 0
        end = t0
        while pending:
            t, outs = steps.get(timeout=600)
            for o in outs:
                if o.finish == "error":
                    raise RuntimeError(f"engine error on {o.key}: {o.error_message}")
                tm.add(o.key, t, o.n)
                useful += o.n
                if o.finish is not None:
                    pending.discard(o.key)
                    end = t
        # The KV pools (slots x length) as sized: on a GPU from the memory free at the start, which a path
        # before it may still hold (transformers' continuous batching takes 90% for its paged cache).
        pools = "+".join(f"{n}x{length}" for n, length in engine.runner.cache.pools)
        note = f"{engine.sched.preemptions} preemptions, {engine.steps} steps, KV pools {pools}"
        if step_log is not None:
            step_log.extend(engine.profile.steps)
        return tm.result(useful, end - t0, note)
    finally:
        engine.stop()


def _engine_request(r: BenchRequest, *, session: str = "") -> GenerationRequest:
    params = SamplingParams(max_tokens=r.out_len, temperature=0.0, ignore_eos=True)
    return GenerationRequest(r.key, prompt_ids=list(r.prompt_ids), params=params, session=session)


def _engine_warmup(
    engine: BatchingEngine, steps: queue.Queue[tuple[float, list[StepOutput]]], reqs: Sequence[BenchRequest]
) -> None:
    warm = warmup_requests(reqs)
    for r in warm:
        engine.submit(_engine_request(r))
    pending = {r.key for r in warm}
    while pending:
        _, outs = steps.get(timeout=600)
        pending -= {o.key for o in outs if o.finish}


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def run_late_join(loaded: LoadedModel, reqs: Sequence[BenchRequest]) -> dict[str, float]:
    """TTFT of a request arriving while all the others decode, against its own prefill time (its TTFT
    on an idle engine) plus two decode steps (median step interval just before it arrives)."""
    try:
        return _late_join(loaded, reqs)
    finally:
        _release(loaded.device)


def _late_join(loaded: LoadedModel, reqs: Sequence[BenchRequest]) -> dict[str, float]:
    engine = in_own_thread(lambda: BatchingEngine(loaded))  # as in _engine
    steps: queue.Queue[tuple[float, list[StepOutput]]] = queue.Queue()
    engine.start(lambda outs: steps.put((time.perf_counter(), outs)))

    def first_token(key: str, since: float) -> float:
        while True:
            t, outs = steps.get(timeout=600)
            if any(o.key == key and o.n > 0 for o in outs):
                return (t - since) * 1000

    try:
        late, others = reqs[-1], reqs[:-1]
        _engine_warmup(engine, steps, reqs)
        t0 = time.perf_counter()
        engine.submit(_engine_request(BenchRequest("alone", late.prompt_ids, 1)))
        alone = first_token("alone", t0)
        for r in others:
            engine.submit(_engine_request(BenchRequest(r.key, r.prompt_ids, OUT_MAX)))
        started: set[str] = set()
        times: list[float] = []
        while len(started) < len(others) or len(times) < 6:  # everyone decoding, then a few steps
            t, outs = steps.get(timeout=600)
            started.update(o.key for o in outs if o.n > 0)
            if len(started) == len(others):
                times.append(t)
        step_ms = statistics.median(b - a for a, b in itertools.pairwise(times)) * 1000
        t0 = time.perf_counter()
        engine.submit(_engine_request(BenchRequest("late", late.prompt_ids, 4)))
        ttft = first_token("late", t0)
    finally:
        engine.stop()
    bound = alone + 2 * step_ms
    return {
        "ttft_ms": round(ttft, 1),
        "prefill_alone_ms": round(alone, 1),
        "decode_step_ms": round(step_ms, 1),
        "bound_ms": round(bound, 1),
        "running": len(reqs) - 1,
    }


# ---- multi-turn TTFT -------------------------------------------------------------------------------


def run_turns(loaded: LoadedModel, turns: int, *, reuse: bool, repeats: int = 3) -> list[float]:
    """TTFT (ms) of each turn of a chat session, the engine otherwise idle: per turn, the median over
    ``repeats`` fresh sessions (a shared machine makes single timings noisy)."""
    runs = [_session(loaded, turns, reuse=reuse) for _ in range(repeats)]
    return [round(statistics.median(r[t] for r in runs), 1) for t in range(turns)]


def _session(loaded: LoadedModel, turns: int, *, reuse: bool, reply_tokens: int = 48) -> list[float]:
    engine = in_own_thread(lambda: BatchingEngine(loaded, prefix_reuse=reuse))  # as in _engine
    steps: queue.Queue[tuple[float, list[StepOutput]]] = queue.Queue()
    engine.start(lambda outs: steps.put((time.perf_counter(), outs)))
    messages: list[dict[str, str]] = []
    ttfts: list[float] = []
    params = SamplingParams(max_tokens=reply_tokens, temperature=0.0, ignore_eos=True)
    try:
        for turn in range(turns):
            topic = TOPICS[turn % len(TOPICS)]
            messages.append({"role": "user", "content": f"Turn {turn + 1}: tell me one fact about {topic}."})
            key = f"turn{turn}"
            t0 = time.perf_counter()
            engine.submit(GenerationRequest(key, list(messages), params, session="bench-session"))
            first: float | None = None
            text = []
            done = False
            while not done:
                t, outs = steps.get(timeout=600)
                for o in (o for o in outs if o.key == key):
                    first = t if first is None and o.n > 0 else first
                    text.append(o.text)
                    done = done or o.finish is not None
            ttfts.append(((first or t) - t0) * 1000)
            messages.append({"role": "assistant", "content": "".join(text)})
    finally:
        engine.stop()
    return ttfts
