"""Ragged SFT data, whole runs: ``fast`` vs the stock Trainer with a padding collator and vs TRL's padding-free
SFTTrainer, non-padding tokens per second of wall clock over a whole run (set-up, cold compile and every
recompile included).

    python benchmarks/bench_sft.py                                   # stock, fast, trl, trl-ckpt; 200 steps
    python benchmarks/bench_sft.py --variants fast,fast-buckets      # dynamic rows vs bucketed static rows
    python benchmarks/bench_sft.py --steps 60 --reps 2 --json out.json

Data: 1,600 rows (200 steps x batch 8, every row used once), lengths log-uniform in [16, 512], token ids of the
embedded tiny task; the embedded tiny Llama (4 x 256, vocab 512), fp32, the same rows and initial weights
for every variant. Every run is a fresh process with an empty inductor cache (a cold compile), and runs of
the variants alternate (rep 1 of each, then rep 2, ...). Throughput = the rows' real tokens / wall clock from
building the trainer to the end of ``train()``.

Variants:
  stock         transformers.Trainer, DataCollatorForLanguageModeling (pads each batch to its longest row)
  fast          SpeedupTrainer(speedup="fast"), given the same padding collator (compile.when: pays_back on CPU:
                the blocks compile only if the run is long enough to earn the cold compile back)
  fast-always   fast with compile.when: always (compiled from the first step, whatever the run length)
  fast-eager    fast without compile (padding-free rows + sdpa_varlen only)
  fast-sdpa     fast with attention sdpa (the block-diagonal mask) instead of sdpa_varlen, compiled from the start
  fast-buckets  fast with static shapes: rows padded to the next power of two (a padding "sequence"), dynamic=False
  trl           trl.SFTTrainer(SFTConfig(padding_free=True, max_length=None, gradient_checkpointing=False))
  trl-ckpt      the same with TRL's default gradient_checkpointing=True
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VARIANTS = ("stock", "fast", "fast-always", "fast-eager", "fast-sdpa", "fast-buckets", "trl", "trl-ckpt")


def rows(n: int, seed: int = 0, lo: int = 16, hi: int = 512, vocab: int = 512) -> list[list[int]]:
    """Token ids of the tiny task's text, cut at log-uniform lengths."""
    sys.path.insert(0, ROOT)
    from hf_speedup.tiny import char_tokenizer, make_dataset

    rng = random.Random(seed)
    lengths = [int(round(math.exp(rng.uniform(math.log(lo), math.log(hi))))) for _ in range(n)]
    stream = [t for ids in make_dataset(char_tokenizer(), n=8 * n, seed=seed)["input_ids"] for t in ids]
    out, pos = [], 0
    for length in lengths:
        if pos + length > len(stream):
            pos = 0
        out.append(stream[pos:pos + length])
        pos += length
    return out


class PowerOfTwoRows:
    """Padding-free rows padded to the next power of two tokens (a trailing padding sequence, labels -100)."""

    def __init__(self, inner, pad_id: int):
        self.inner, self.pad_id = inner, pad_id

    def __call__(self, features):
        import torch

        batch = self.inner(features)
        n = batch["input_ids"].shape[1]
        extra = (1 << max(0, (n - 1).bit_length())) - n
        if extra:
            batch["input_ids"] = torch.cat([batch["input_ids"], torch.full((1, extra), self.pad_id)], 1)
            batch["labels"] = torch.cat([batch["labels"], torch.full((1, extra), -100)], 1)
            batch["position_ids"] = torch.cat([batch["position_ids"], torch.arange(extra)[None]], 1)
        return batch


def run_one(variant: str, steps: int, batch: int, seed: int) -> dict:
    """One whole run in this process; returns tokens, seconds and what the trainer reported."""
    sys.path.insert(0, ROOT)
    import torch
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    from hf_speedup.tiny import causal_lm_collator, char_tokenizer, tiny_llama

    data = rows(steps * batch, seed)
    tokens = sum(len(r) for r in data)
    dataset = Dataset.from_dict({"input_ids": data, "attention_mask": [[1] * len(r) for r in data]})
    tok = char_tokenizer()
    kw = dict(output_dir=tempfile.mkdtemp(prefix="bench_sft_"), per_device_train_batch_size=batch, max_steps=steps,
              learning_rate=1e-3, lr_scheduler_type="constant", seed=seed, logging_steps=10**9, save_strategy="no",
              report_to=[], disable_tqdm=True, dataloader_num_workers=0, use_cpu=True, bf16=False)
    model = tiny_llama(seed=seed)
    start = time.perf_counter()
    if variant == "stock":
        trainer = Trainer(model=model, args=TrainingArguments(**kw), train_dataset=dataset,
                          data_collator=causal_lm_collator(tok))
    elif variant.startswith("trl"):
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**kw, padding_free=True, max_length=None, gradient_checkpointing=variant == "trl-ckpt")
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset.remove_columns("attention_mask"),
                             processing_class=tok)
    else:
        from hf_speedup import SpeedupTrainer, get_preset
        from hf_speedup.features.data.padding_free import PaddingFreeCollator

        config, collator = get_preset("fast"), causal_lm_collator(tok)
        if variant == "fast-eager":
            config = config.replace(compile={"enabled": False})
        elif variant == "fast-always":
            config = config.replace(compile={"when": "always"})
        elif variant == "fast-sdpa":
            config = config.replace(attention={"implementation": "sdpa"}, compile={"when": "always"})
        elif variant == "fast-buckets":
            config = config.replace(data={"padding_free": False}, attention={"implementation": "sdpa_varlen"},
                                    compile={"dynamic": False, "when": "always"})
            collator = PowerOfTwoRows(PaddingFreeCollator("input_ids", pad_token_id=tok.pad_token_id), tok.pad_token_id)
        trainer = SpeedupTrainer(model=model, args=TrainingArguments(**kw), train_dataset=dataset,
                                 data_collator=collator, speedup=config)
        trainer.speedup_callback.print_tables = False
    trainer.train()
    seconds = time.perf_counter() - start
    out = {"variant": variant, "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
           "threads": torch.get_num_threads()}
    report = getattr(trainer, "speedup_report", None)
    if report is not None:
        d = report.to_dict()
        out.update({k: d["metrics"].get(k) for k in ("tokens_per_second", "whole_run_tokens_per_second",
                                                     "compile_seconds", "recompile_seconds", "recompiles")},
                   tokens_per_second=tokens / seconds, steady_tokens_per_second=d["metrics"]["tokens_per_second"],
                   applied={f: d["plan"][f]["applied"] for f in ("data", "attention", "compile")},
                   compiled=bool(d["plan"]["compile"]["engaged"]))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="stock,fast,trl,trl-ckpt")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a worker: run this variant, print JSON
    a = p.parse_args(argv)
    if a.one:
        print("RESULT " + json.dumps(run_one(a.one, a.steps, a.batch_size, a.seed)), flush=True)
        return 0
    variants = [v for v in a.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: {unknown} unknown; allowed: {', '.join(VARIANTS)}")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    for rep in range(a.reps):
        for v in variants:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor_cold_"),
                   "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
            cmd = [sys.executable, __file__, "--one", v, "--steps", str(a.steps), "--batch-size", str(a.batch_size),
                   "--seed", str(a.seed)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if done.returncode or not line:
                print(f"{v} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
                return 1
            r = json.loads(line[-1][7:])
            results[v].append(r)
            print(f"rep {rep + 1} {v:13s} {r['tokens_per_second']:8.0f} tok/s whole run ({r['seconds']:.1f} s)"
                  + (f", steady {r['steady_tokens_per_second']:.0f} tok/s, blocks {'compiled' if r['compiled'] else 'eager'}"
                     f", compile {r['compile_seconds']:.1f} s, recompiles {r['recompiles']}"
                     if "steady_tokens_per_second" in r else ""), flush=True)
    base = {v: sorted(x["tokens_per_second"] for x in rs)[len(rs) // 2] for v, rs in results.items()}
    print("\nmedian whole-run tokens/s and ratios")
    for v, tps in base.items():
        ratios = ", ".join(f"x{tps / base[o]:.2f} vs {o}" for o in ("stock", "trl") if o in base and o != v)
        print(f"  {v:13s} {tps:8.0f}  {ratios}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "results": results}, fh,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
