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

def math_fwd(q, k, v):
    # q,k,v: (B,H,T,D) bf16. returns o (bf16), lse fp32 (B,H,T)
    T = q.shape[2]
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    s.masked_fill_(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).to(q.dtype)
    o = torch.matmul(p, v)
    return o, lse

def math_bwd(g, q, k, v, o, lse):
    T = q.shape[2]
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    s.masked_fill_(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(s - lse[..., None])
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
def flash_bwd(g, q, k, v, o, l):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, o, l, 0.0, True, attn_mask=None, scale=scale)

def check():
    q, k, v = (torch.randn(1, H, 200, D, dtype=torch.bfloat16) for _ in range(3))
    g = torch.randn(1, H, 200, D, dtype=torch.bfloat16)
    o1, l1 = flash_fwd(q.float(), k.float(), v.float()); d1 = flash_bwd(g.float(), q.float(), k.float(), v.float(), o1, l1)
    o2, l2 = math_fwd(q, k, v); d2 = math_bwd(g, q, k, v, o2, l2)
    o3, l3 = flash_fwd(q, k, v); d3 = flash_bwd(g, q, k, v, o3, l3)
    for a, b, c in zip((o1, l1) + tuple(d1), (o2, l2) + tuple(d2), (o3, l3) + tuple(d3)):
        print("err math %.4f flash-bf16 %.4f" % ((a - b.float()).abs().max() / a.abs().max(), (a - c.float()).abs().max() / a.abs().max()))
check()
def run(kind, T, dt):
    q, k, v = (torch.randn(1, H, T, D, dtype=dt) for _ in range(3)); g = torch.randn(1, H, T, D, dtype=dt)
    f, b = (math_fwd, math_bwd) if kind == "math" else (flash_fwd, flash_bwd)
    def step():
        o, l = f(q, k, v); b(g, q, k, v, o, l)
    step(); ts = []
    for _ in range(9):
        t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
    return statistics.median(ts)
for T in [int(x) for x in sys.argv[1:]] or (64, 128, 256, 346, 512, 768, 1024):
    r = {name: run(kind, T, dt) for name, kind, dt in (("flash32", "flash", torch.float32), ("flash16", "flash", torch.bfloat16), ("math16", "math", torch.bfloat16))}
    print(T, " ".join(f"{k} {v*1e3:.2f}ms" for k, v in r.items()), " best:", min(r, key=r.get))
