"""hf_speedup's ``blocked`` CPU attention kernel against torch's CPU flash kernel (as ``sdpa_varlen`` runs it),
forward + backward in bf16, causal, at SmolLM2-135M's attention shape (9 heads over 3 key/value heads of 64) and a
Llama-style one (32 over 8 of 128), one sequence and a padding-free row of ragged documents, with this machine's
bf16 matmul peak (a 2048^3 GEMM) timed in the same run. Where the CPU has matrix units oneDNN drives (AMX) the
kernel's tiled form runs, and its ATen-bmm form is timed beside it (``blocked.FORM``).

    python benchmarks/attention_blocked.py                      # 512, 1,024, 4,096 tokens
    python benchmarks/attention_blocked.py --lengths 1024 --repeats 9

FLOPs counted as the report counts attention: causal forward + backward = 7 x heads x T^2 x dim per sequence
(2 GEMMs forward, 5 backward with the scores recomputed, half the square each); ragged rows count each document
(log-uniform lengths of 32 .. tokens / 2 at these lengths, the row the door times for padding-free runs: ``door.documents``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_speedup.features.attention import blocked, door, sdpa_varlen

SHAPES = {"smollm2": (9, 3, 64), "llama": (32, 8, 128)}


def timed(step, repeats: int) -> float:
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak(repeats: int = 5) -> float:
    a, b = torch.randn(2048, 2048, dtype=torch.bfloat16), torch.randn(2048, 2048, dtype=torch.bfloat16)
    return 2 * 2048 ** 3 / min(timed(lambda: a @ b, 1) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=5)
    ns = parser.parse_args()
    ok, why = blocked.load()
    if not ok:
        raise SystemExit(why)
    peaks = [matmul_peak()]
    print(f"{why}; {torch.get_num_threads()} threads")
    print("| shape | tokens | row | flash ms | bmm form ms | blocked ms (form) | blocked / flash speed "
          "| blocked / bmm form | flash GFLOP/s | blocked GFLOP/s | blocked % of peak |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape_name, (heads, kv, dim) in SHAPES.items():
        for tokens in ns.lengths:
            for row in ("one sequence", "ragged documents"):
                docs = door.documents(tokens, row)
                positions = torch.cat([torch.arange(n) for n in docs])[None]
                g = torch.Generator().manual_seed(0)
                q = torch.randn(1, tokens, heads, dim, generator=g).bfloat16().transpose(1, 2)
                k, v = (torch.randn(1, kv, tokens, dim, generator=g).bfloat16() for _ in range(2))
                grad = torch.randn(1, heads, tokens, dim, generator=g).bfloat16()
                flops = sum(7 * heads * n * n * dim for n in docs)
                # what the door times: torch's kernel, and blocked in each form (the fastest counts)
                found = door.timing((heads, kv, dim), tokens, torch.bfloat16, "here", docs, ns.repeats).value
                flash, mine = found["sdpa_varlen"], found["blocked"]
                blocked.use("bmm")
                bmm = timed(lambda: door.blocked_step(q, k, v, grad, positions, dim ** -0.5), ns.repeats)
                blocked.use(None)
                peaks.append(matmul_peak(2))
                peak = statistics.median(peaks)
                print(f"| {shape_name} {heads}/{kv}x{dim} | {tokens:,} | {row} ({len(docs)}) | {flash * 1e3:.1f} | "
                      f"{bmm * 1e3:.1f} | {mine * 1e3:.1f} ({found.get('form', 'bmm')}) | {flash / mine:.2f}x "
                      f"| {bmm / mine:.2f}x | {flops / flash / 1e9:.0f} | {flops / mine / 1e9:.0f} "
                      f"| {flops / mine / peak:.1%} |", flush=True)
    print(f"bf16 matmul peak: median {statistics.median(peaks) / 1e9:.0f} GFLOP/s of {len(peaks)} timings between "
          f"the rows ({min(peaks) / 1e9:.0f}-{max(peaks) / 1e9:.0f})")
    sdpa_varlen.native_gqa()


if __name__ == "__main__":
    main()
