"""estimate_memory against the measured live-tensor peak of one LoRA step, at several sequence lengths (CPU).

SmolLM2-135M (``benchmarks/smollm2_dir.py``) loaded by ``load_model`` as each preset plans it (a bf16 base under
LoRA where bf16 is chosen), LoRA r=16 on every Linear, batch 1, random token ids, every row ``seq`` tokens. Each
(preset, length) runs in its own process: the estimate made before training, then a SpeedupTrainer run of two
steps with ``memory.track_live_tensors`` (torch's MemTracker over the second step: every storage alive, parameters,
adapter gradients and states, activations, temporaries) and, beside it, torch.profiler's memory events (the
allocator's own running total: it also sees the temporaries a kernel allocates inside itself, which a dispatch mode
such as MemTracker cannot). Prints one JSON row per run and a Markdown table.

    python benchmarks/smollm2_dir.py /tmp/smollm2
    python benchmarks/estimate_at_length.py --model /tmp/smollm2 --presets lora memory+lora --lengths 1024 2048 4096

``memory+lora`` is the ``memory`` preset with ``base: lora``'s adapters (``{"base": "memory", "lora": {...}}``).
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

PRESETS = {
    "lora": "lora",
    "memory+lora": {"base": "memory", "lora": {"enabled": True}},
}


def one_run(model_dir: str, preset: str, seq: int) -> dict:
    """One (preset, length): the estimate, then a tracked step; returns the row."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    from allocator_peak import allocator_peak_callback
    from datasets import Dataset
    from transformers import TrainingArguments, default_data_collator

    from hf_speedup import SpeedupTrainer, estimate_memory
    from hf_speedup.loading import load_model
    from hf_speedup.presets import resolve

    cfg = resolve(PRESETS[preset]).replace(memory={"track_live_tensors": True})
    model = load_model(model_dir, speedup=cfg)
    model.config.use_cache = False
    est = estimate_memory(model, speedup=cfg, batch_size=1, seq_len=seq)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (4, seq), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * seq] * 4, "labels": ids})
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=2, logging_steps=1,
                                 report_to=[], use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0,
                                 disable_tqdm=True)
        allocator = allocator_peak_callback(step=2)
        trainer = SpeedupTrainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                                 speedup=cfg, callbacks=[allocator])
        trainer.speedup_callback.print_tables = False
        trainer.train()
    report = trainer.speedup_report.to_dict()
    live = report["measurement"]["live_tensor_peak"]
    plan = {k: report["plan"][k]["applied"] for k in ("precision", "lora", "checkpointing", "loss", "compile")}
    return {"preset": preset, "seq_len": seq, "estimate": est.peak_tensor_bytes, "peak_phase": est.peak_phase,
            "breakdown": est.breakdown, "measured": live["bytes"], "by_category": live["by_category"], "plan": plan,
            "allocator": allocator.result.get("bytes"),
            "dtypes": sorted({str(p.dtype) for p in model.parameters()})}


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def table(rows: list[dict]) -> str:
    out = ["| preset | tokens | estimate MiB (peak at) | MemTracker MiB | est/MemTracker | allocator MiB | "
           "est/allocator |", "|---" * 7 + "|"]
    for r in rows:
        alloc = r.get("allocator") or 0
        by_alloc = f"{mib(alloc)} | **{r['estimate'] / alloc:.3f}** |" if alloc else "- | - |"
        out.append(f"| {r['preset']} | {r['seq_len']} | {mib(r['estimate'])} ({r['peak_phase']}) | "
                   f"{mib(r['measured'])} | **{r['estimate'] / r['measured']:.3f}** | {by_alloc}")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="SmolLM2-135M folder (benchmarks/smollm2_dir.py)")
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048, 4096])
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--one", nargs=2, metavar=("PRESET", "SEQ"), help=argparse.SUPPRESS)  # the worker
    a = p.parse_args(argv)
    if a.one:
        print("ROW " + json.dumps(one_run(a.model, a.one[0], int(a.one[1]))), flush=True)
        return 0
    rows = []
    for preset in a.presets:
        for seq in a.lengths:
            done = subprocess.run([sys.executable, __file__, "--model", a.model, "--one", preset, str(seq)],
                                  capture_output=True, text=True)
            line = next((ln for ln in done.stdout.splitlines() if ln.startswith("ROW ")), None)
            if line is None:
                print(done.stdout[-3000:], done.stderr[-3000:], file=sys.stderr)
                return 1
            rows.append(json.loads(line[4:]))
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
