"""Long context on one GPU: the device-memory peak of one LoRA step of a Llama-3.1-8B-shaped model (random bf16
weights built from its config: memory does not depend on the values) against the sequence length, for the stock
Trainer with gradient checkpointing and SDPA, and for ``long``; the slope and constant of each, the longest length
they predict for this GPU, and (``--try``) one step at a given length to check the prediction.

    bash benchmarks/gpu_plan.sh long                                  # the GPU plan's call of this script
    python benchmarks/long_gpu.py --lengths 8192 16384 32768 --output $OUT
    python benchmarks/long_gpu.py --variants long --lengths 65536 --try 262144 --output $OUT

Each variant runs in its own process: the model is built once, the trainer set up once (its plan applied: LoRA
r=16 on every Linear, the tiled MLP, the offloaded block inputs), then one ``training_step`` per length with
``torch.cuda.max_memory_allocated`` read around it; an out-of-memory step is recorded as such. Attention work grows
with the square of the length, so a step at 128K tokens takes about a minute on an H100: keep the lengths short
and predict, then ``--try`` one length.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, max_position_embeddings=1048576, rope_theta=500000.0)
LORA = {"enabled": True, "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
VARIANTS = {"stock+gc": {"base": "baseline", "lora": LORA, "attention": {"implementation": "sdpa"}},
            "long": {"base": "long", "lora": LORA}}


def one_variant(variant: str, lengths: list[int], layers: int | None) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    import time

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from hf_speedup import SpeedupTrainer

    cfg = LlamaConfig(**{**LLAMA_8B, **({"num_hidden_layers": layers} if layers else {})})
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.config.use_cache = False
    stock = variant == "stock+gc"
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=1, report_to=[], bf16=True,
                                 gradient_checkpointing=stock, save_strategy="no")
        trainer = SpeedupTrainer(model=model, args=args, train_dataset=[{"input_ids": [1]}], speedup=VARIANTS[variant])
        trainer.speedup_callback.print_tables = False
    if stock:  # the stock Trainer turns it on inside train(): here, as it would
        trainer.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    trainer.model.train()
    rows = []
    for seq in lengths:
        ids = torch.randint(0, cfg.vocab_size, (1, seq), device="cuda")
        batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(seq, device="cuda")[None]}
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        try:
            trainer.training_step(trainer.model, batch)
            torch.cuda.synchronize()
            peak, status = torch.cuda.max_memory_allocated(), "ok"
        except torch.OutOfMemoryError:
            peak, status = None, "out of memory"
        trainer.model.zero_grad(set_to_none=True)
        rows.append({"variant": variant, "seq_len": seq, "status": status, "peak_bytes": peak, "base_bytes": base,
                     "seconds": round(time.perf_counter() - start, 1),
                     "device": torch.cuda.get_device_name(), "device_bytes": torch.cuda.get_device_properties(0).total_memory,
                     "plan": {k: v.applied for k, v in trainer.speedup_status.items()
                              if k in ("checkpointing", "tiled_mlp", "loss", "attention", "lora")}})
        print("ROW " + json.dumps(rows[-1]), flush=True)
        if status != "ok":
            break
    return rows


def predict(rows: list[dict]) -> dict:
    """Slope and constant from the two longest lengths that ran, and the longest length that fits the device."""
    ok = sorted((r for r in rows if r["status"] == "ok"), key=lambda r: r["seq_len"])
    if len(ok) < 2:
        return {}
    a, b = ok[-2], ok[-1]
    slope = (b["peak_bytes"] - a["peak_bytes"]) / (b["seq_len"] - a["seq_len"])
    constant = a["peak_bytes"] - slope * a["seq_len"]
    usable = 0.95 * a["device_bytes"]
    return {"bytes_per_token": slope, "constant_bytes": constant, "longest_predicted": int((usable - constant) / slope)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--lengths", nargs="+", type=int, default=[8192, 16384, 32768])
    p.add_argument("--try", dest="try_len", type=int, default=None, help="then one step at this length")
    p.add_argument("--layers", type=int, default=None, help="fewer blocks (same shapes), for a quick check")
    p.add_argument("--output", default=os.environ.get("OUT", "runs/long_gpu"))
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        one_variant(a.one, a.lengths + ([a.try_len] if a.try_len else []), a.layers)
        return 0
    os.makedirs(a.output, exist_ok=True)
    summary = {}
    for variant in a.variants:
        cmd = [sys.executable, __file__, "--one", variant, "--lengths", *map(str, a.lengths)]
        cmd += (["--try", str(a.try_len)] if a.try_len else []) + (["--layers", str(a.layers)] if a.layers else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        rows = [json.loads(ln[4:]) for ln in done.stdout.splitlines() if ln.startswith("ROW ")]
        if not rows:
            print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
        summary[variant] = {"rows": rows, **predict([r for r in rows if r["seq_len"] in a.lengths])}
        print(json.dumps({variant: summary[variant]}, indent=1), flush=True)
    Path(a.output, "long_gpu.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
