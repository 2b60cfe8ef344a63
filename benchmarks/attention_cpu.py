"""The CPU attention kernel in fp32 against bf16 (and an explicit matmul + softmax path in bf16), forward +
backward, one causal sequence of SmolLM2's attention shape (9 heads x 64), at several lengths: where the step's
attention time goes on a CPU with bf16 matmuls (benchmarks/RESULTS.md, "The step against the peak").

    python benchmarks/attention_cpu.py                 # lengths 64 ... 1024
    python benchmarks/attention_cpu.py 128 1024        # chosen lengths
"""
import statistics
import sys
import time

import torch

torch.manual_seed(0)
aten = torch.ops.aten
H, D = 9, 64
scale = D ** -0.5


def causal_scores(q, k):
    T = q.shape[2]
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    return s.masked_fill_(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))


def math_fwd(q, k, v):
    """(B, H, T, D) in bf16 -> output in bf16, log-sum-exp in fp32 (B, H, T); the probabilities are not kept."""
    s = causal_scores(q, k)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).to(q.dtype)
    o = torch.matmul(p, v)
    return o, lse


def math_bwd(g, q, k, v, o, lse):
    """Gradients of q, k, v with the probabilities recomputed from q, k and the log-sum-exp (as flash does)."""
    p = torch.exp(causal_scores(q, k) - lse[..., None])
    pb = p.to(q.dtype)
    dv = torch.matmul(pb.transpose(-1, -2), g)
    dp = torch.matmul(g, v.transpose(-1, -2)).float()
    delta = (g.float() * o.float()).sum(-1, keepdim=True)
    ds = (p * (dp - delta) * scale).to(q.dtype)
    dq = torch.matmul(ds, k)
    dk = torch.matmul(ds.transpose(-1, -2), q)
    return dq, dk, dv


def flash_fwd(q, k, v):
    return aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, attn_mask=None, scale=scale)


def flash_bwd(g, q, k, v, o, lse):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, o, lse, 0.0, True, attn_mask=None,
                                                                     scale=scale)


def check() -> None:
    """Each path's outputs and gradients against the fp32 flash kernel, as relative max errors."""
    q, k, v, g = (torch.randn(1, H, 200, D, dtype=torch.bfloat16) for _ in range(4))
    o1, l1 = flash_fwd(q.float(), k.float(), v.float())
    d1 = flash_bwd(g.float(), q.float(), k.float(), v.float(), o1, l1)
    o2, l2 = math_fwd(q, k, v)
    d2 = math_bwd(g, q, k, v, o2, l2)
    o3, l3 = flash_fwd(q, k, v)
    d3 = flash_bwd(g, q, k, v, o3, l3)
    for ref, math, flash16 in zip((o1, l1, *d1), (o2, l2, *d2), (o3, l3, *d3)):
        scale_of = ref.abs().max()
        print(f"rel. error: math {(ref - math.float()).abs().max() / scale_of:.4f}, "
              f"flash bf16 {(ref - flash16.float()).abs().max() / scale_of:.4f}")


def run(kind: str, T: int, dtype: torch.dtype) -> float:
    """Median seconds of one forward + backward over 9 timed repeats (after one warm-up)."""
    q, k, v, g = (torch.randn(1, H, T, D, dtype=dtype) for _ in range(4))
    fwd, bwd = (math_fwd, math_bwd) if kind == "math" else (flash_fwd, flash_bwd)

    def step():
        o, lse = fwd(q, k, v)
        bwd(g, q, k, v, o, lse)

    step()
    times = []
    for _ in range(9):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


if __name__ == "__main__":
    check()
    variants = (("flash32", "flash", torch.float32), ("flash16", "flash", torch.bfloat16),
                ("math16", "math", torch.bfloat16))
    for T in [int(x) for x in sys.argv[1:]] or (64, 128, 256, 346, 512, 768, 1024):
        r = {name: run(kind, T, dtype) for name, kind, dtype in variants}
        print(T, " ".join(f"{k} {v * 1e3:.2f}ms" for k, v in r.items()), " best:", min(r, key=r.get))
