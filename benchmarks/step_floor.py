"""The exact-fp32 floor of a training step: its GEMMs and attention kernels alone, at their best.

    python benchmarks/bench_fast.py --variants stock,fast,floor
    (the ``floor`` variant is :func:`floor_variant`, run by ``hf_speedup.bench`` as a custom variant)

A training step's matrix products are fixed by the model and the batch: no setting that keeps the math
exact removes any of them (compile fuses the elementwise work around them; it does not remove products).
So no exact preset built on these kernels (MKL/oneDNN GEMMs, torch's flash attention) can beat the
step's own GEMMs and attention run back to back with nothing else in between: no norms, activations,
loss, optimizer or loop. The ``floor`` variant of ``bench_fast.py`` measures that, lock-stepped with the
real Trainers, so ``floor``'s "x stock" is the ceiling of such a speed-up on this machine, reached only
if everything else in the step were free:

1. :func:`record_gemms` records every GEMM (``aten.mm``/``addmm``/``bmm``: sizes and strides) of one
   stock forward + backward pass.
2. :class:`Replay` binds each to the faster of the default BLAS (MKL) and oneDNN for its shape (the
   choice ``fast`` makes) and runs them back to back; :func:`attention_timer` runs flash attention
   forward + backward with the step's shapes for every block.
3. :func:`machine_peak` is the best large-GEMM throughput here, to show how close the step's GEMMs run to
   the hardware.
"""

from __future__ import annotations

import time


def record_gemms(model, batch) -> list[tuple]:
    """(op, ((size, stride), ...)) of every GEMM in one forward + backward of ``model`` on ``batch``."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    gemm_ops = {aten.mm.default: "mm", aten.addmm.default: "addmm", aten.bmm.default: "bmm"}
    seen: list[tuple] = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in gemm_ops:
                mats = args[1:3] if func is aten.addmm.default else args[:2]
                seen.append((gemm_ops[func], tuple((tuple(t.shape), tuple(t.stride())) for t in mats)))
            return func(*args, **(kwargs or {}))

    with Recorder():
        model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    return seen


def gemm_flops(gemms) -> float:
    total = 0.0
    for op, ((sa, _), (sb, _)) in gemms:
        batch = sa[0] if op == "bmm" else 1
        m, k = sa[-2:]
        total += 2.0 * batch * m * k * sb[-1]
    return total


class Replay:
    """The step's GEMMs as real tensors, each bound to the faster library for its shape (as in ``fast``)."""

    def __init__(self, gemms):
        import torch

        from hf_speedup.features.compile.cpu_gemm import benchmark_gemm, onednn_mm

        self.calls = []
        chosen: dict = {}
        for op, key in gemms:
            a, b = (torch.empty_strided(size, stride).normal_() for size, stride in key)
            if op == "bmm":
                self.calls.append((torch.bmm, a, b))
                continue
            if key not in chosen:
                chosen[key] = benchmark_gemm(key)["choice"]
            self.calls.append((onednn_mm if chosen[key] == "onednn" else torch.mm, a, b))
        self.onednn = sum(1 for fn, *_ in self.calls if fn is onednn_mm)

    def __call__(self) -> float:
        start = time.perf_counter()
        for fn, a, b in self.calls:
            fn(a, b)
        return time.perf_counter() - start


def attention_timer(model, batch_size: int, seq_len: int):
    """Flash attention forward + backward for every decoder block, with the step's shapes."""
    import torch
    import torch.nn.functional as F

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (batch_size, cfg.num_attention_heads, seq_len, head_dim)
    q, k, v = (torch.randn(shape, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape)

    def run() -> float:
        start = time.perf_counter()
        for _ in range(cfg.num_hidden_layers):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(out, (q, k, v), grad)
        return time.perf_counter() - start

    return run


def machine_peak() -> float:
    """Best large-GEMM throughput here (FLOP/s): 2048^2 fp32, best of MKL and oneDNN, best of 5."""
    import torch

    from hf_speedup.features.compile.cpu_gemm import onednn_mm

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    best = float("inf")
    for fn in (torch.mm, onednn_mm, torch.mm, onednn_mm):
        fn(a, b)
        for _ in range(5):
            start = time.perf_counter()
            fn(a, b)
            best = min(best, time.perf_counter() - start)
    return 2.0 * 2048**3 / best


class Floor:
    """One lock-step of the ``floor`` variant: the step's GEMMs replayed, then every block's attention."""

    def __init__(self, model, batch, batch_size: int, seq_len: int):
        gemms = record_gemms(model, batch)
        self.replay = Replay(gemms)
        self.attention = attention_timer(model, batch_size, seq_len)
        self.gemm_gflop = gemm_flops(gemms) / 1e9
        self.peak_gflops = None
        self.parts: list[tuple[float, float]] = []

    def step(self) -> None:
        if self.peak_gflops is None:  # in the first (warm-up) lock-step: alone on the machine
            self.peak_gflops = machine_peak() / 1e9
        self.parts.append((self.replay(), self.attention()))

    def info(self, skip: int) -> dict:
        import statistics

        gemm = statistics.median(g for g, _ in self.parts[skip:])
        attention = statistics.median(a for _, a in self.parts[skip:])
        return {"ceiling_reason": (
            f"{len(self.replay.calls)} GEMMs of the step ({self.gemm_gflop:.2f} GFLOP, {self.replay.onednn} on "
            f"oneDNN) replayed back to back: {1e3 * gemm:.1f} ms, {self.gemm_gflop / gemm:.0f} GFLOP/s (this "
            f"machine's best large GEMM: {self.peak_gflops:.0f} GFLOP/s); flash attention forward + backward, "
            f"all blocks: {1e3 * attention:.1f} ms")}


def floor_variant(ctx) -> Floor:
    """``hf_speedup.bench`` custom-variant factory: the floor of the step of ``ctx.model`` on the first batch
    (fixed-length data, so every step of the Trainers has this shape)."""
    rows = [ctx.dataset[i] for i in range(ctx.batch_size)]
    return Floor(ctx.model, ctx.collator(rows), ctx.batch_size, max(len(r["input_ids"]) for r in rows))
