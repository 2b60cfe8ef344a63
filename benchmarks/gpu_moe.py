"""Mixture-of-experts kernels on a GPU: what ``experts: auto`` measures and chooses, and the loop against
``grouped_mm`` / ``batched_mm`` in a whole training step, plus the run's matmul peak.

    python benchmarks/gpu_moe.py --output DIR             # on a CUDA machine (about 2 minutes on one H200)
    python benchmarks/gpu_moe.py --device cpu --small     # the same path, shrunk, on CPU

Part 1, the door's own timing (``hf_speedup.features.experts.timing.time_implementations``: one MoE layer
forward+backward, bf16 weights) at the real models' expert shapes: Qwen3-30B-A3B (hidden 2048, expert width 768,
128 experts, top-8), OLMoE-1B-7B (2048, 1024, 64, top-8), Mixtral-8x7B (4096, 14336, 8, top-2), 8,192 tokens.
Part 2: ``plan_for("auto")`` on a scaled-down model of each shape (measuring at the door), the choice and reason.
Part 3: the scaled-down models trained in lock step (same seed, same batches, AdamW, bf16 autocast) with each
implementation: steady step (median after 2 warm-up steps) and losses.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

REAL = {  # hidden, expert width, experts, top-k (the published configs)
    "qwen3_moe (30B-A3B)": dict(hidden=2048, width=768, experts=128, top_k=8),
    "olmoe (1B-7B)": dict(hidden=2048, width=1024, experts=64, top_k=8),
    "mixtral (8x7B)": dict(hidden=4096, width=14336, experts=8, top_k=2),
}


def scaled(arch: str, hidden: int, layers: int):
    import transformers as T

    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                  vocab_size=32000, max_position_embeddings=4096, attention_dropout=0.0, pad_token_id=0)
    if arch.startswith("qwen3"):
        return T.Qwen3MoeConfig(**common, head_dim=hidden // 8, num_experts=128, num_experts_per_tok=8,
                                moe_intermediate_size=hidden * 3 // 8, intermediate_size=2 * hidden)
    if arch.startswith("olmoe"):
        return T.OlmoeConfig(**common, num_experts=64, num_experts_per_tok=8, intermediate_size=hidden // 2)
    return T.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2, intermediate_size=hidden * 7 // 2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="tiny shapes (a CPU check of the script)")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--output", default=None)
    a = p.parse_args()
    if a.steps < 3:
        p.error("--steps must be at least 3 (the steady step is the median after 2 warm-up steps)")
    import transformers as T

    from hf_speedup import measured, plan_for
    from hf_speedup.features.experts.timing import time_implementations
    from hf_speedup.report.measure.matmul_peak import time_matmul_peak

    small = a.small
    tokens = 256 if small else a.tokens
    names = ("eager", "batched_mm", "grouped_mm")
    rows: dict = {"device": torch.cuda.get_device_name() if a.device == "cuda" else a.device,
                  "torch": torch.__version__, "transformers": T.__version__, "layer": [], "auto": [], "train": []}
    dtype = torch.bfloat16
    if not small:
        flops, how = time_matmul_peak(torch.device(a.device).type, "bf16")
        rows["matmul_peak_bf16_tflops"] = flops / 1e12
        print(f"matmul peak bf16: {flops / 1e12:.0f} TFLOP/s ({how})", flush=True)
    for arch, s in REAL.items():
        s = dict(s, tokens=tokens)
        if small:
            s.update(hidden=64, width=32, experts=8, top_k=2)
        t = time_implementations(s, names, a.device, dtype, dtype)
        rows["layer"].append({"arch": arch, **s, **{k: (v * 1e3 if isinstance(v, float) else v) for k, v in t.items()}})
        print(json.dumps(rows["layer"][-1]), flush=True)
    hidden, layers, batch, seq = (64, 2, 2, 64) if small else (1024, 4, 4, 2048)
    for arch in REAL:
        os.environ[measured.MEASURE_ENV] = "1"
        os.environ[measured.CACHE_ENV] = tempfile.mkdtemp(prefix="gpu_moe_cache_")
        cfg = scaled(arch, hidden, layers)
        torch.manual_seed(0)
        probe = T.AutoModelForCausalLM.from_config(cfg)
        start = time.perf_counter()
        d = plan_for("auto", model=probe)["experts"]
        rows["auto"].append({"arch": arch, "applied": d.applied, "door_s": time.perf_counter() - start,
                             "reason": d.reason})
        print(json.dumps(rows["auto"][-1]), flush=True)
        del probe
        g = torch.Generator().manual_seed(1)
        data = [torch.randint(3, 32000, (batch, seq), generator=g).to(a.device) for _ in range(a.steps)]
        models, opts, times, losses = {}, {}, {}, {}
        for k in ("eager", "grouped_mm"):
            torch.manual_seed(0)
            # a config of its own: from_config keeps the object, and set_experts_implementation writes into it
            m = T.AutoModelForCausalLM.from_config(copy.deepcopy(cfg)).to(a.device)
            m.set_experts_implementation(k)
            m.train()
            models[k], opts[k], times[k], losses[k] = m, torch.optim.AdamW(m.parameters(), lr=1e-4), [], []
        sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
        for x in data:
            for k, m in models.items():
                sync()
                t0 = time.perf_counter()
                with torch.autocast(torch.device(a.device).type, dtype=dtype):
                    loss = m(x, labels=x).loss
                loss.backward()
                opts[k].step()
                opts[k].zero_grad(set_to_none=True)
                sync()
                times[k].append(time.perf_counter() - t0)
                losses[k].append(round(loss.item(), 4))
        loop = statistics.median(times["eager"][2:])
        for k in models:
            steady = statistics.median(times[k][2:])
            rows["train"].append({"arch": arch, "kernel": k, "steady_ms": steady * 1e3, "x_loop": loop / steady,
                                  "whole_s": sum(times[k]), "losses": losses[k]})
            print(json.dumps(rows["train"][-1]), flush=True)
        del models, opts
        if a.device == "cuda":
            torch.cuda.empty_cache()
    if a.output:
        os.makedirs(a.output, exist_ok=True)
        with open(os.path.join(a.output, "gpu_moe.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
