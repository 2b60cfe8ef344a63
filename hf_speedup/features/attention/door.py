"""The attention feature's ``measure`` hook: on CPU, ``auto`` times torch's CPU flash kernel (as ``sdpa_varlen``
runs it) against hf_speedup's ``blocked`` kernel, forward + backward at the model's attention shapes, the planned
length and dtype, and the plan takes the faster (``caps.measured["attention.cpu_kernel"]``). Cached per machine,
shapes, length, dtype and kernel source by :func:`hf_speedup.measured.cached`; GPUs keep their kernels."""

from __future__ import annotations

import hashlib
import math
import logging
import statistics
import time

import torch

from ...measured import Measurement, cached
from . import blocked, sdpa_varlen

logger = logging.getLogger("hf_speedup")
MEASURED = "attention.cpu_kernel"
DEFAULT_TOKENS = 1024  # the length timed where no memory.seq_len says the run's


def _shapes(info) -> tuple[int, int, int] | None:
    shape = getattr(info, "shape", None)
    if shape is None or not shape.num_heads or not shape.head_dim:
        return None
    if getattr(info, "value_head_dim", None) or getattr(info, "sliding_window", None) or \
            getattr(info, "attention_softcap", None):
        return None  # neither kernel serves it (see attention.usable)
    return shape.num_heads, shape.num_kv_heads or shape.num_heads, shape.head_dim


def measure(config, caps, info) -> dict:
    if caps.device_type != "cpu" or config.attention.implementation != "auto" or info is None:
        return {}
    if "interface" not in getattr(info, "attention_kernels", ()) or "sdpa" not in info.attention_kernels:
        return {}
    shapes = _shapes(info)
    if shapes is None:
        return {}
    from ..experts.door import compute_dtype

    dtype = compute_dtype(config, caps, info)
    if dtype not in (torch.float32, torch.bfloat16):
        return {}
    tokens = int(config.memory.seq_len or DEFAULT_TOKENS)
    rows = "one sequence" if config.data.padding_free is False else "ragged documents"
    threads = torch.get_num_threads()
    where = f"{caps.device_name}, {threads} thread(s), torch {torch.__version__}"
    source = hashlib.sha256(b"".join(path.read_bytes() for path in blocked.SOURCES)).hexdigest()[:12]
    key = {"device": caps.device_name, "threads": threads, "torch": torch.__version__, "shapes": shapes,
           "tokens": tokens, "rows": rows, "dtype": str(dtype), "kernel": source, "block": blocked.BLOCK,
           "tiles": blocked.TILE_CHOICES}
    result = cached(MEASURED, key, lambda: timing(shapes, tokens, dtype, where, documents(tokens, rows)))
    logger.info("hf_speedup attention: %s", result.text())
    return {MEASURED: result}


def documents(tokens: int, rows: str, seed: int = 0) -> list[int]:
    """The sequences of the timed row: one, or (padding-free rows) log-uniform lengths of min(32, tokens / 4) ..
    tokens / 2 filling it, the last cut to fit."""
    if rows == "one sequence" or tokens < 8:
        return [tokens]
    g = torch.Generator().manual_seed(seed)
    low, high = math.log(min(32.0, tokens / 4)), math.log(tokens / 2)
    docs, left = [], tokens
    while left > 0:
        n = int(math.exp(float(torch.empty(1).uniform_(low, high, generator=g))))
        docs.append(min(left, max(n, 1)))
        left -= docs[-1]
    return docs


def timing(shapes: tuple[int, int, int], tokens: int, dtype: torch.dtype, where: str, docs: list[int] | None = None,
           repeats: int = 3) -> Measurement:
    """Seconds of one causal forward + backward of each kernel on a row of ``tokens`` tokens holding ``docs``
    sequences (median of ``repeats`` after a warm-up); a kernel that cannot run here gets its reason instead."""
    heads, kv_heads, dim = shapes
    docs = docs or [tokens]
    name = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    row = "one sequence" if len(docs) == 1 else f"a padding-free row of {len(docs)} sequences"
    what = (f"causal attention forward + backward, {heads} heads over {kv_heads} key/value heads of {dim}, "
            f"{tokens} tokens ({row}), {name}")
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, tokens, heads, dim, generator=generator).to(dtype).transpose(1, 2)
    k, v = (torch.randn(1, kv_heads, tokens, dim, generator=generator).to(dtype) for _ in range(2))
    grad = torch.randn(1, heads, tokens, dim, generator=generator).to(dtype)
    positions = torch.cat([torch.arange(n) for n in docs])[None]
    table: dict[str, float | str] = {}
    sdpa_varlen.native_gqa()
    ok, why = blocked.load()
    runs = {"sdpa_varlen": (_varlen_step, None)}
    if not ok:
        table["blocked"] = why
    elif blocked.can_tile(q):  # each tile size of the tiled form and the bmm form: the fastest is the kernel's figure
        runs.update({f"blocked@{form}": (blocked_step, form) for form in (*blocked.TILE_CHOICES, "bmm")})
    else:
        runs["blocked"] = (blocked_step, None)
    saved = blocked.FORM[0]
    for kernel, (step, form) in runs.items():
        calls, tiled = blocked.CALLS[0], blocked.TILED[0]
        times = []
        try:
            if form:
                blocked.use(form)
            for i in range(repeats + 1):
                start = time.perf_counter()
                step(q, k, v, grad, positions, dim ** -0.5)
                if i:
                    times.append(time.perf_counter() - start)
        finally:
            blocked.FORM[0] = saved
            blocked.CALLS[0], blocked.TILED[0] = calls, tiled  # timings are not training
        table[kernel] = statistics.median(times)
    candidates = {name: t for name, t in table.items() if name.startswith("blocked@")}
    if candidates:
        best = min(candidates, key=candidates.get)
        table["blocked"], table["form"] = candidates[best], best.split("@")[1]
    return Measurement(value=table, what=what, where=where)


def measured_form(value: dict) -> str | None:
    """The form the door timed fastest ("64x128": tiles of 64 queries x 128 keys, or "bmm"); None where only one
    form could run."""
    form = value.get("form") if isinstance(value, dict) else None
    return form if isinstance(form, str) and (form == "bmm" or form.count("x") == 1) else None


def _varlen_step(q, k, v, grad, positions, scale):
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not sdpa_varlen.native_gqa():
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out, lse = torch.ops.hf_speedup.sdpa_varlen(q, k, v, positions, scale)
    torch.ops.hf_speedup.sdpa_varlen_backward(grad, q, k, v, out, lse, positions, scale)


def blocked_step(q, k, v, grad, positions, scale):
    out, lse = torch.ops.hf_speedup.blocked_attention(q, k, v, positions, scale, blocked.BLOCK)
    torch.ops.hf_speedup.blocked_attention_backward(grad, q, k, v, out, lse, positions, scale, blocked.BLOCK)
