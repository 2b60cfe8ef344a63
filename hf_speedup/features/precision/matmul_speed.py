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
of the two step times, each shape weighted by its share of the step's matmul FLOPs (blocks x occurrences; the
head once). Each shape's ratio is the median over adjacent fp32/bf16 pairs of runs, so load that comes and goes on
a shared machine slows both sides of a pair alike; where the first and second half of the pairs disagree by more
than ``MAX_SPREAD`` the load changed under the timing, and the figure is neither used nor cached.

The sizes: ``TOKENS`` rows per GEMM (1,024 tokens: past ~1K rows a GEMM's speed per token is flat, and a step
of 4-8 rows x 512 tokens runs these GEMMs at 2-4K rows); outputs wider than ``MAX_COLUMNS`` (the LM head) are
timed on their first ``MAX_COLUMNS`` columns and scaled, so the measurement stays ~1-2 s cold on 2 cores. The
step's other work (attention, norms, activations, the optimizer) does not speed up in bf16, which is why
``THRESHOLD`` asks for more than 1x.
"""

from __future__ import annotations

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
SHAPE_SECONDS = 0.15  # a small shape's pairs of runs go on this long (at most MAX_REPS pairs)
MAX_REPS = 200
MIN_PAIRS, MIN_PAIRS_LARGE = 6, 4  # pairs of runs per shape at least (a large shape: above FLOP_BUDGET)
MAX_SPREAD = 0.15  # the halves of the timing may differ this much; more, and the load changed while timing
# bf16 on a CPU without AMX runs at most ~2x the fp32 FLOP rate (avx512_bf16 dot products) plus halved memory
# traffic: a shape measured outside this range was timed on a machine too busy to time (threads descheduled
# mid-GEMM), and such a figure is neither used nor cached
PLAUSIBLE = (0.1, 6.0)
FLOP_BUDGET = 6e9  # a shape above this many FLOPs per fwd+bwd is timed in fewer pairs (MIN_PAIRS_LARGE)


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


def time_shape(fan_in: int, fan_out: int, tokens: int = TOKENS) -> list[float]:
    """fp32 seconds / bf16-autocast seconds of one forward + backward of ``x @ W.T`` at this shape, one ratio per
    adjacent pair of runs (their order alternating): load that comes and goes slows both runs of a pair alike,
    where the best of each dtype alone would compare a lucky fp32 moment with an unlucky bf16 one."""
    cols = min(fan_out, MAX_COLUMNS)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, fan_in, generator=gen).requires_grad_()
    w = (torch.randn(cols, fan_in, generator=gen) / fan_in ** 0.5).requires_grad_()
    grads = {False: torch.randn(tokens, cols, generator=gen)}
    grads[True] = grads[False].to(torch.bfloat16)  # what reaches a bf16 output from the ops after it
    reps = MIN_PAIRS_LARGE if 6 * tokens * fan_in * cols > FLOP_BUDGET else MIN_PAIRS
    for bf16 in (False, True):  # warm-up: oneDNN builds its bf16 primitives on the first call
        _run(x, w, grads[bf16], bf16)
    start, ratios = time.perf_counter(), []
    while len(ratios) < reps or (time.perf_counter() - start < SHAPE_SECONDS and len(ratios) < MAX_REPS):
        order = (False, True) if len(ratios) % 2 == 0 else (True, False)
        took = {bf16: _run(x, w, grads[bf16], bf16) for bf16 in order}
        ratios.append(took[False] / took[True])
    return ratios


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _describe(shapes: list[tuple[int, int, int]]) -> str:
    return ", ".join(f"{k}x{n}" + (f" x{c}" if c > 1 else "") for k, n, c in shapes)


def bf16_matmul_ratio(shapes: list[tuple[int, int, int]], tokens: int = TOKENS) -> tuple[float, dict, float]:
    """The step-weighted bf16/fp32 speed ratio of ``shapes`` (each shape's median pair ratio, weighted by its share
    of the step's matmul FLOPs), the per-shape ratios, and how far the ratio of the pairs' first and second halves
    differ (a machine whose load changed while timing gives halves that disagree)."""
    flops = {(k, n): count * k * n for k, n, count in shapes}
    total = sum(flops.values())
    whole = first = second = 0.0
    each: dict = {}
    for k, n, _ in shapes:
        ratios = time_shape(k, n, tokens)
        share, half = flops[(k, n)] / total, len(ratios) // 2
        whole += share / _median(ratios)  # time fractions add up: the step's bf16 time over its fp32 time
        first += share / _median(ratios[:half] or ratios)
        second += share / _median(ratios[half:])
        each[f"{k}x{n}"] = round(_median(ratios), 2)
    return 1.0 / whole, each, abs(second - first) / max(first, second)


def measure(config, caps, model) -> dict:
    """The ``measure`` hook (:func:`hf_speedup.plan.measure`): ``{KEY: Measurement}`` where ``precision.dtype:
    auto`` is still open on a CPU without native bf16; ``{}`` elsewhere (CUDA's flags are right, AMX is bf16)."""
    if not wanted(config, caps, model):
        return {}
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
        ratio, each, spread = bf16_matmul_ratio(shapes)
        what = (f"bf16 autocast vs fp32, forward + backward with the casts, {TOKENS} tokens through "
                f"{_describe(shapes)} (in x out x per step); per shape {each}")
        if all(PLAUSIBLE[0] <= r <= PLAUSIBLE[1] for r in each.values()) and spread <= MAX_SPREAD:
            result = Measurement(round(ratio, 3), what, where)
            record(KEY, key, result)
            return {KEY: result}
    return {KEY: Measurement(None, f"{what}: the two halves of the timing differ by {spread:.0%} or a shape fell "
                                   f"outside {PLAUSIBLE[0]}-{PLAUSIBLE[1]}x: this machine was too busy to time "
                                   "(not cached)", where)}


def wanted(config, caps, model) -> bool:
    """Measure only where the figure can decide: ``auto`` on a CPU without AMX, fp32 weights."""
    return (config.precision.dtype == "auto" and caps.device_type == "cpu" and not caps.bf16
            and model is not None and model.dtype == "float32")
