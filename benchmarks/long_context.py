"""Long context on CPU: the live-tensor peak of one LoRA step against the sequence length, for the stock Trainer
with gradient checkpointing, ``memory`` and ``long``, on SmolLM2-135M and on a 2-block cut of it (same shapes,
where one block's working set dominates what grows with the length).

    python benchmarks/smollm2_dir.py /tmp/smollm2
    python benchmarks/long_context.py --model /tmp/smollm2 --lengths 1024 2048 4096 8192 [--blocks 2]
    python benchmarks/long_context.py --model /tmp/smollm2 --lengths 2048 --time 4     # step times, no tracking

Every row is one process: SmolLM2 loaded with a bf16 base, LoRA r=16 on every Linear (dropout 0), batch 1, one
row of ``seq`` random tokens, ``max_steps=1`` under torch's MemTracker (``memory.track_live_tensors``: every
storage alive, adapters, their gradients and states, activations, temporaries). The stock Trainer is the
``baseline`` preset (the stock Trainer step for step) with ``gradient_checkpointing=True`` and ``bf16=True`` in
its TrainingArguments. ``--time N`` instead trains N steps untracked and reports the median steady step.
The per-token slope is the least-squares slope of the peak over the lengths; the floor is what checkpointing
must keep, each block's input (blocks x hidden x 2 bytes per token).
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
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

LORA = {"enabled": True, "r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}
VARIANTS = {
    "stock+gc": {"base": "baseline", "lora": LORA},
    "memory": {"base": "memory", "lora": LORA},
    "long": {"base": "long", "lora": LORA},
    "long@2048": {"base": "long", "lora": LORA, "tiled_mlp": {"tile_tokens": 2048}},  # fixed 2,048-token tiles
}


def one_run(model_dir: str, variant: str, seq: int, blocks: int | None, time_steps: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainingArguments, default_data_collator

    from hf_speedup import SpeedupTrainer, estimate_memory
    from hf_speedup.presets import resolve

    cfg = resolve(VARIANTS[variant]).replace(memory={"track_live_tensors": not time_steps, "seq_len": seq},
                                             precision={"dtype": "bf16"} if variant != "stock+gc" else {})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    if blocks:
        model.model.layers = model.model.layers[:blocks]
        model.config.num_hidden_layers = blocks
        model.config.layer_types = model.config.layer_types[:blocks] if getattr(model.config, "layer_types", None) \
            else None
    model.config.use_cache = False
    est = None
    if variant != "stock+gc":
        est = estimate_memory(model, speedup=cfg, batch_size=1, seq_len=seq).peak_tensor_bytes
    g = torch.Generator().manual_seed(0)
    rows = max(time_steps, 1)
    ids = torch.randint(3, model.config.vocab_size, (rows, seq), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * seq] * rows, "labels": ids})
    stock = dict(gradient_checkpointing=True, bf16=True) if variant == "stock+gc" else {}
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=rows, logging_steps=1,
                                 report_to=[], use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0,
                                 disable_tqdm=True, **stock)
        trainer = SpeedupTrainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                                 speedup=cfg)
        trainer.speedup_callback.print_tables = False
        trainer.train()
    report = trainer.speedup_report.to_dict()
    live = report["measurement"].get("live_tensor_peak") or {}
    loss = next(h["loss"] for h in trainer.state.log_history if "loss" in h)
    return {"variant": variant, "seq_len": seq, "blocks": blocks or model.config.num_hidden_layers,
            "hidden": model.config.hidden_size, "measured": live.get("bytes"), "by_category": live.get("by_category"),
            "estimate": est, "first_loss": loss, "step_time_s": report["metrics"].get("step_time_s"),
            "plan": {k: report["plan"][k]["applied"] for k in ("precision", "lora", "checkpointing", "tiled_mlp",
                                                                 "loss", "attention", "data")}}


def slope(rows: list[dict]) -> float:
    xs = [r["seq_len"] for r in rows]
    ys = [r["measured"] for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def table(rows: list[dict]) -> str:
    lengths = sorted({r["seq_len"] for r in rows})
    out = ["| variant | " + " | ".join(f"{n} tokens MiB" for n in lengths) + " | KiB/token | x floor |",
           "|---" * (len(lengths) + 3) + "|"]
    for variant in VARIANTS:
        mine = sorted((r for r in rows if r["variant"] == variant and r["measured"]), key=lambda r: r["seq_len"])
        if not mine:
            continue
        floor = mine[0]["blocks"] * mine[0]["hidden"] * 2
        cells = [f"{r['measured'] / 2**20:,.1f}" for r in mine]
        s = slope(mine) if len(mine) > 1 else float("nan")
        out.append(f"| {variant} | " + " | ".join(cells) + f" | {s / 1024:,.1f} | {s / floor:.2f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="SmolLM2-135M folder (benchmarks/smollm2_dir.py)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    p.add_argument("--blocks", type=int, default=None, help="keep only the first N blocks (same shapes)")
    p.add_argument("--time", type=int, default=0, help="train N steps untracked and report the step time instead")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--one", nargs=2, metavar=("VARIANT", "SEQ"), help=argparse.SUPPRESS)  # the worker
    a = p.parse_args(argv)
    if a.one:
        print("ROW " + json.dumps(one_run(a.model, a.one[0], int(a.one[1]), a.blocks, a.time)), flush=True)
        return 0
    rows = []
    for variant in a.variants:
        for seq in a.lengths:
            cmd = [sys.executable, __file__, "--model", a.model, "--one", variant, str(seq), "--time", str(a.time)]
            done = subprocess.run(cmd + (["--blocks", str(a.blocks)] if a.blocks else []), capture_output=True,
                                  text=True)
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("ROW ")), None)
            if line is None:
                print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                return 1
            rows.append(json.loads(line[4:]))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "by_category"}), flush=True)
    if not a.time:
        print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
