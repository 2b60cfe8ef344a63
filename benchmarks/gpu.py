"""The GPU plan: a Llama-3.2-1B-shaped model, seq 2048, bf16, every preset against the stock peers.

    python benchmarks/gpu.py --output runs/gpu                       # the whole plan, one H100, ~10 minutes
    python benchmarks/gpu.py --variants stock,fast --steps 40        # a subset
    python benchmarks/gpu.py --dry-run --output /tmp/gpu_dry          # the same plan, tiny config, on CPU

This is ``hf-speedup bench --profile gpu-1b`` (``hf_speedup.bench.options.PROFILES``): a ``LlamaConfig`` with
Llama-3.2-1B's sizes (16 blocks, hidden 2048, MLP 8192, 32 heads, 8 KV heads, vocab 128,256, tied
embeddings), random weights built from the config (no hub); ``--data fixed`` rows of 2048 real tokens
(the embedded arithmetic / reversal text), batch 4, bf16 TrainingArguments for every variant; variants
stock, stock-compile, liger, fast, memory, stock-peft (the stock Trainer on peft with the ``lora`` preset's
adapters: the reference of lora and qlora), lora, qlora; 8 warm-up + 22 timed steps each, one variant after
another in a fresh process (one GPU does not hold them all at once), 300 s per phase at most. Everything
lands in ``--output``: bench.json, bench.md, bench.png, one log per variant. Any other ``hf-speedup bench``
flag may follow (``--steps``, ``--batch-size``, ``--presets``, ``--peers``, ...).

``--dry-run`` keeps the plan and shrinks it to a CPU (2 blocks, hidden 64, seq 128, 3 steps): CUDA-only
variants become rows with their reason (liger; qlora falls back to plain LoRA, as the preset says).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository


def bench_argv(argv: list[str]) -> list[str]:
    """This script's flags as ``hf-speedup bench`` flags (``--variants a,b`` splits into peers and presets)."""
    from hf_speedup.bench.options import variant_kind

    out = ["--profile", "gpu-1b"]
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--variants" or arg.startswith("--variants="):
            value = arg.split("=", 1)[1] if "=" in arg else args.pop(0)
            names = [v.strip() for v in value.split(",") if v.strip()]
            out += ["--peers", ",".join(v for v in names if variant_kind(v) == "peer"),
                    "--presets", ",".join(v for v in names if variant_kind(v) != "peer")]
        else:
            out.append(arg)
    if "--output" not in out:
        out += ["--output", "runs/gpu"]
    return out


def main(argv: list[str] | None = None) -> int:
    from hf_speedup.bench import main as bench_main

    return bench_main(bench_argv(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
