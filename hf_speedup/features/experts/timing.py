"""The door's measurement for ``experts.implementation: auto``: one mixture-of-experts layer (router, top-k, the
routed experts) forward and backward at the model's own shapes, once per implementation, on the device the run
trains on, in the dtype it computes in. Timed in process, cached per machine by :func:`hf_speedup.measured.cached`.

The layer is transformers' own dispatch (``@use_experts_implementation``) around the same per-expert loop the
models ship (Qwen3-MoE's, gated SwiGLU experts stored ``(experts, out, in)``), so each implementation is the code
the model would run. Random weights and inputs: the routing is what random routers give (near uniform over the
experts), which is what a freshly initialised or a load-balanced router sees.
"""

from __future__ import annotations

import contextlib
import time

import torch
from torch import nn

from ...dtypes import short_name
from ...measured import Measurement

TOKENS = 1024  # a typical micro-batch: 4 x 256 tokens
REPEATS = 3  # timed rounds after one warm-up, implementations in turn; the fastest of each counts
GATHER_LIMIT = 1 << 30  # batched_mm gathers each token's expert weights: not timed above 1 GiB of them


def _experts_class():
    from transformers.activations import ACT2FN
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation
    class BenchExperts(nn.Module):
        def __init__(self, config, experts: int, hidden: int, width: int):
            super().__init__()
            self.num_experts = experts
            self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * width, hidden) * hidden ** -0.5)
            self.down_proj = nn.Parameter(torch.randn(experts, hidden, width) * width ** -0.5)
            self.act_fn = ACT2FN["silu"]

        def forward(self, hidden_states, top_k_index, top_k_weights):  # transformers' loop (Qwen3-MoE's)
            final = torch.zeros_like(hidden_states)
            with torch.no_grad():
                mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
                hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
            for e in hit:
                e = e[0]
                if e == self.num_experts:
                    continue
                pos, idx = torch.where(mask[e])
                gate, up = nn.functional.linear(hidden_states[idx], self.gate_up_proj[e]).chunk(2, dim=-1)
                out = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
                final.index_add_(0, idx, (out * top_k_weights[idx, pos, None]).to(final.dtype))
            return final

    return BenchExperts


class _Config:
    _experts_implementation = "eager"


def shapes(info) -> dict | None:
    """hidden, expert width, experts, top-k of ``info`` (None where the model has no routed experts to time)."""
    shape = getattr(info, "shape", None)
    if shape is None or not shape.block_experts or not shape.experts_per_token or not shape.expert_intermediate_size:
        return None
    return {"hidden": shape.hidden_size, "width": shape.expert_intermediate_size,
            "experts": shape.block_experts[0][1], "top_k": shape.experts_per_token, "tokens": TOKENS}


def gathered_bytes(s: dict, element_bytes: int) -> int:
    """What batched_mm gathers: both expert weights once per (token, routed expert) pair."""
    return s["tokens"] * s["top_k"] * 3 * s["width"] * s["hidden"] * element_bytes


def time_implementations(s: dict, names, device: str, weight_dtype: torch.dtype,
                         compute_dtype: torch.dtype) -> dict[str, float | str]:
    """{implementation: seconds of one forward + backward} (or why it was not timed)."""
    torch.manual_seed(0)
    config = _Config()
    layer = _experts_class()(config, s["experts"], s["hidden"], s["width"]).to(device=device, dtype=weight_dtype)
    router = nn.Linear(s["hidden"], s["experts"], bias=False).to(device=device, dtype=weight_dtype)
    # a new batch (so a new routing, new per-expert token counts) for every timed call: training never sees one
    # routing twice, and the loop's GEMM shapes follow the token counts
    inputs = (torch.randn(s["tokens"], s["hidden"], device=device, dtype=weight_dtype, requires_grad=True)
              for _ in range((REPEATS + 1) * len(names)))  # made one at a time
    x = None
    autocast = torch.autocast(torch.device(device).type, dtype=compute_dtype) if compute_dtype != weight_dtype \
        else contextlib.nullcontext()
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)

    def step():
        nonlocal x
        x = next(inputs, x)
        with autocast:
            probs = router(x).float().softmax(-1)
            weights, index = probs.topk(s["top_k"], dim=-1)
            out = layer(x, index, (weights / weights.sum(-1, keepdim=True)).to(x.dtype))
        out.float().square().mean().backward()

    def timed(name: str) -> float:
        config._experts_implementation = name
        try:
            sync()
            start = time.perf_counter()
            step()
            sync()
            return time.perf_counter() - start
        finally:
            for p in (*layer.parameters(), *router.parameters(), x):
                p.grad = None

    out: dict[str, float | str] = {}
    element = torch.finfo(compute_dtype).bits // 8
    for name in names:  # warm-up (kernel selection, allocator); what cannot run here says why
        if name == "batched_mm" and gathered_bytes(s, element) > GATHER_LIMIT:
            out[name] = (f"not timed: it would gather {gathered_bytes(s, element) / 2**30:.1f} GiB of expert "
                         "weights per layer")
            continue
        try:
            timed(name)
            out[name] = float("inf")
        except (RuntimeError, NotImplementedError, ValueError) as exc:  # a kernel this build lacks
            out[name] = f"failed: {str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__}"
    runnable = [n for n in names if out.get(n) == float("inf")]
    for _ in range(REPEATS):  # round robin, so a busy moment of the machine does not fall on one implementation
        for name in runnable:
            out[name] = min(out[name], timed(name))
    return out


def measurement(s: dict, names, device: str, weight_dtype: torch.dtype, compute_dtype: torch.dtype,
                where: str) -> Measurement:
    cuda = torch.device(device)
    devices = [cuda.index if cuda.index is not None else torch.cuda.current_device()] if cuda.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the caller's random state is left as it was (seeds, dropout)
        table = time_implementations(s, names, device, weight_dtype, compute_dtype)
    dtype = short_name(compute_dtype) if compute_dtype == weight_dtype else \
        f"{short_name(weight_dtype)} weights under {short_name(compute_dtype)} autocast"
    what = (f"one MoE layer forward+backward at the model's shapes (hidden {s['hidden']}, expert width {s['width']}, "
            f"{s['experts']} experts, top-{s['top_k']}, {s['tokens']} tokens, {dtype})")
    return Measurement(value=table, what=what, where=where)
