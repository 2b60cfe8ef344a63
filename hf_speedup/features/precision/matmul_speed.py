"""How much faster bf16 autocast runs this model's matmuls on this CPU: the figure ``precision.dtype: auto``
decides by on a CPU without AMX, where no capability flag can tell.

Whether bf16 pays on an AVX-512 CPU with avx512_bf16 but no AMX depends on the shapes: on a 2-core AMD EPYC
(Zen 4) a bf16 matmul at a 135M model's shapes (hidden 576, intermediate 1536, a 49,152-wide head) ran 2.0-2.7x
the fp32 one, while a toy model's (hidden 64-256) trained slower in bf16 (the casts dominate). So it is timed,
once per machine and model shape (:func:`hf_speedup.measured.cached`), at the door, before the pure plan.

What is timed: every distinct linear of a decoder block (``ModelShape.block_linears``) and the LM head, each as
one training step runs it, forward ``x @ W.T`` and backward (``grad_x`` and ``grad_W``) through autograd, once in
fp32 and once under ``torch.autocast("cpu", bfloat16)``, which includes the casts autocast adds (the fp32 weight
cast to bf16 on every forward, the activations cast in, the gradients cast back to fp32). The value is the ratio
of the two total times, each shape weighted by how often a step runs it (blocks x occurrences; the head once), so
a FLOP-weighted bf16/fp32 speed ratio of the step's matmuls.

The sizes: ``TOKENS`` rows per GEMM (1,024 tokens: past ~1K rows a GEMM's speed per token is flat, and a step
of 4-8 rows x 512 tokens runs these GEMMs at 2-4K rows); outputs wider than ``MAX_COLUMNS`` (the LM head) are
timed on their first ``MAX_COLUMNS`` columns and scaled, so the measurement stays ~1-2 s cold on 2 cores. The
step's other work (attention, norms, activations, the optimizer) does not speed up in bf16, which is why
``THRESHOLD`` asks for more than 1x.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import torch

from ...measured import Measurement, lookup, record

KEY = "precision.bf16_matmul"  # Capabilities.measured key: Measurement(value = bf16 speed / fp32 speed)
# bf16 is chosen when its matmuls measure at least this many times fp32. The matmuls are 60-80% of a small
# decoder's CPU step; the rest (attention, norms, activations, loss, optimizer) does not speed up and autocast adds
# casts to it, so a 1.25x GEMM speed-up is worth ~1.1-1.2x of a step (1 / (0.3 + 0.7 / 1.25) = 1.16): below that a
# bf16 step is no faster within noise, and its rounding is not free. Above it the step gains clearly.
THRESHOLD = 1.25
TOKENS = 1024  # rows of every timed GEMM
MAX_COLUMNS = 4096  # a wider output (the LM head) is timed on this many columns and its time scaled
SHAPE_SECONDS = 0.05  # a small shape's pairs of runs go on this long (at most MAX_REPS pairs)
MAX_REPS = 200
# bf16 on a CPU without AMX runs at most ~2x the fp32 FLOP rate (avx512_bf16 dot products) plus halved memory
# traffic: a shape measured outside this range was timed on a machine too busy to time (threads descheduled
# mid-GEMM), and such a figure is neither used nor cached
PLAUSIBLE = (0.1, 6.0)
FLOP_BUDGET = 6e9  # a shape above this many FLOPs per fwd+bwd is timed twice after a warm-up (else three times)


def gemm_shapes(model) -> list[tuple[int, int, int]]:
    """(in_features, out_features, times one step runs it) for the blocks' linears and the LM head."""
    shape = getattr(model, "shape", None)
    counts: Counter = Counter()
    blocks = (shape.num_blocks if shape is not None else 0) or model.num_blocks or model.num_layers or 0
    if shape is not None and shape.block_linears:
        for _, fan_in, fan_out in shape.block_linears:
            counts[(fan_in, fan_out)] += blocks
    elif shape is not None and shape.hidden_size and shape.intermediate_size:  # no linears seen: a Llama block
        h, i = shape.hidden_size, shape.intermediate_size
        counts[(h, h)] += 2 * blocks
        counts[(h, shape.kv_width or h)] += 2 * blocks
        counts[(h, i)] += 2 * blocks
        counts[(i, h)] += blocks
    hidden = (shape.hidden_size if shape is not None else None) or model.hidden_size
    vocab = (shape.vocab_size if shape is not None else None) or model.vocab_size
    if hidden and vocab and model.head in ("causal_lm", "masked_lm", "none", "unknown") and counts:
        counts[(hidden, vocab)] += 1
    return sorted((k, n, c) for (k, n), c in counts.items() if c > 0)


def _run(x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, bf16: bool) -> float:
    x.grad = w.grad = None
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = torch.nn.functional.linear(x, w)
    out.backward(grad)
    return time.perf_counter() - start


def time_shape(fan_in: int, fan_out: int, tokens: int = TOKENS) -> tuple[float, float]:
    """(fp32 seconds, bf16-autocast seconds) of one forward + backward of ``x @ W.T`` at this shape, the best of
    interleaved runs (noise only adds time), scaled to the full width when timed on ``MAX_COLUMNS`` columns."""
    cols = min(fan_out, MAX_COLUMNS)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, fan_in, generator=gen).requires_grad_()
    w = (torch.randn(cols, fan_in, generator=gen) / fan_in ** 0.5).requires_grad_()
    grads = {False: torch.randn(tokens, cols, generator=gen)}
    grads[True] = grads[False].to(torch.bfloat16)  # what reaches a bf16 output from the ops after it
    reps = 2 if 6 * tokens * fan_in * cols > FLOP_BUDGET else 3
    best = {False: float("inf"), True: float("inf")}
    for bf16 in (False, True):  # warm-up: oneDNN builds its bf16 primitives on the first call
        _run(x, w, grads[bf16], bf16)
    start, done = time.perf_counter(), 0
    # interleaved pairs, at least ``reps`` and, for small shapes, until SHAPE_SECONDS have passed: on a busy machine
    # one lucky run of a sub-millisecond GEMM would otherwise decide its ratio
    while done < reps or (time.perf_counter() - start < SHAPE_SECONDS and done < MAX_REPS):
        for bf16 in (False, True):
            best[bf16] = min(best[bf16], _run(x, w, grads[bf16], bf16))
        done += 1
    scale = fan_out / cols
    return best[False] * scale, best[True] * scale


def _describe(shapes: list[tuple[int, int, int]]) -> str:
    return ", ".join(f"{k}x{n}" + (f" x{c}" if c > 1 else "") for k, n, c in shapes)


def bf16_matmul_ratio(shapes: list[tuple[int, int, int]], tokens: int = TOKENS) -> tuple[float, dict]:
    """The step-weighted bf16/fp32 speed ratio of ``shapes`` and the per-shape ratios."""
    fp32 = bf16 = 0.0
    each: dict = {}
    for k, n, count in shapes:
        t32, t16 = time_shape(k, n, tokens)
        fp32, bf16 = fp32 + count * t32, bf16 + count * t16
        each[f"{k}x{n}"] = round(t32 / t16, 2)
    return fp32 / bf16, each


def measure(config, caps, model) -> dict:
    """The ``measure`` hook (:func:`hf_speedup.plan.measure`): ``{KEY: Measurement}`` where ``precision.dtype:
    auto`` is still open on a CPU without native bf16; ``{}`` elsewhere (CUDA's flags are right, AMX is bf16)."""
    from ...hardware import FAKE_CPU_AMX

    if not wanted(config, caps, model) or os.environ.get(FAKE_CPU_AMX, "").strip() in ("0", "1"):
        return {}  # a faked CPU kind plans as that kind, not as this machine measures
    shapes = gemm_shapes(model)
    if not shapes:
        return {}
    where = f"{caps.device_name}, {caps.cpu_threads} threads, torch {caps.torch_version}"
    key = {"cpu": caps.device_name, "threads": caps.cpu_threads, "torch": caps.torch_version, "tokens": TOKENS,
           "shapes": [list(s) for s in shapes]}

    found = lookup(KEY, key)
    if found is not None:
        return {KEY: found}
    for _ in range(2):  # a busy moment: once more
        ratio, each = bf16_matmul_ratio(shapes)
        what = (f"bf16 autocast vs fp32, forward + backward with the casts, {TOKENS} tokens through "
                f"{_describe(shapes)} (in x out x per step); per shape {each}")
        if all(PLAUSIBLE[0] <= r <= PLAUSIBLE[1] for r in each.values()):
            result = Measurement(round(ratio, 3), what, where)
            record(KEY, key, result)
            return {KEY: result}
    return {KEY: Measurement(None, f"{what}: a shape outside {PLAUSIBLE[0]}-{PLAUSIBLE[1]}x, this machine was too "
                                   "busy to time (not cached)", where)}


def wanted(config, caps, model) -> bool:
    """Measure only where the figure can decide: ``auto`` on a CPU without AMX, fp32 weights."""
    return (config.precision.dtype == "auto" and caps.device_type == "cpu" and not caps.bf16
            and model is not None and model.dtype == "float32")
