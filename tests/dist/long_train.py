"""The tiled MLP under an engine on two CPU processes (gloo), driven by tests/test_tiled_mlp_distributed.py.

    torchrun --standalone --nproc_per_node 2 tests/dist/long_train.py --engine ddp|fsdp|zero2|zero3 --out DIR

Trains the same tiny model on the same rows twice in fp32, with every block checkpointed: the MLP whole, then
tiled (8 tokens a tile), and counts the collectives each run issued (all-reduce, reduce-scatter, all-gather): a
tiler that reduced gradients per tile would issue more. Under DDP a LoRA run follows, tiled too. Rank 0 writes
``DIR/results.json``: per run the losses, the tiled_mlp report entry and the collective counts.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os

import dist_common  # noqa: F401  (before transformers: the checkout importable, the offline environment)
from dist_common import GLOBAL_BATCH, MODEL, ROOT, this_rank, world_size

COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "all_gather_into_tensor", "all_gather",
               "all_reduce_coalesced", "reduce")


COUNTS: collections.Counter = collections.Counter()


def count_collectives() -> None:
    """torch.distributed's collectives counted from process start, before DeepSpeed keeps references to them (DDP's
    reducer calls the process group directly: its buckets are counted through a comm hook instead)."""
    import torch.distributed as dist

    def counting(name, fn):
        def call(*args, **kwargs):
            COUNTS[name] += 1
            return fn(*args, **kwargs)
        return call

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, counting(name, getattr(dist, name)))


@contextlib.contextmanager
def counted_collectives():
    """The collectives issued inside the block."""
    before = COUNTS.copy()
    counts: collections.Counter = collections.Counter()
    yield counts
    counts.update(COUNTS - before)


def run(engine: str, out: str, tiled: bool, lora: bool = False) -> dict:
    import torch
    from transformers import TrainerCallback, TrainingArguments

    from hf_speedup import SpeedupTrainer
    from hf_speedup.tiny import causal_lm_collator, char_tokenizer, make_rows, tiny_llama

    tok = char_tokenizer()
    rows = make_rows(tok, n=64, seed=0, pack_to=32)
    speedup = {"base": "long", "precision": {"dtype": "fp32"},
               "tiled_mlp": {"enabled": tiled, "tile_tokens": 8}}
    extra = {}
    if engine == "fsdp":
        speedup["fsdp"] = {"enabled": True}
    if engine.startswith("zero"):
        extra["deepspeed"] = str(ROOT / "configs" / "deepspeed" / f"{engine}.json")
    if lora:
        speedup["lora"] = {"enabled": True, "dropout": 0.0}
    args = TrainingArguments(output_dir=out, use_cpu=True, max_steps=4, logging_steps=1, learning_rate=1e-3,
                             per_device_train_batch_size=GLOBAL_BATCH // world_size(), report_to=[], seed=0,
                             save_strategy="no", disable_tqdm=True, **extra)
    trainer = SpeedupTrainer(model=tiny_llama(seed=0, **MODEL), args=args, train_dataset=rows,
                             data_collator=causal_lm_collator(tok), speedup=speedup)
    buckets = collections.Counter()

    class CountBuckets(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            ddp = trainer.model_wrapped
            if engine == "ddp" and isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and not buckets:
                def hook(state, bucket):
                    buckets["ddp_bucket_all_reduce"] += 1
                    return torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook(None, bucket)
                ddp.register_comm_hook(None, hook)
                buckets["registered"] = 1

    trainer.add_callback(CountBuckets())
    with counted_collectives() as counts:
        trainer.train()
    report = trainer.speedup_report.to_dict()
    return {"losses": {int(h["step"]): h["loss"] for h in trainer.state.log_history if "loss" in h},
            "tiled_mlp": report["plan"]["tiled_mlp"], "checkpointing": report["plan"]["checkpointing"],
            "lora": report["plan"]["lora"], "fsdp": report["plan"]["fsdp"], "deepspeed": report["plan"]["deepspeed"],
            "collectives": dict(counts + buckets), "world_size": world_size()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", required=True, choices=("ddp", "fsdp", "zero2", "zero3"))
    p.add_argument("--out", required=True)
    a = p.parse_args()
    count_collectives()
    os.makedirs(a.out, exist_ok=True)
    results = {"whole": run(a.engine, f"{a.out}/whole", tiled=False),
               "tiled": run(a.engine, f"{a.out}/tiled", tiled=True)}
    if a.engine == "ddp":
        results["lora_whole"] = run(a.engine, f"{a.out}/lora_whole", tiled=False, lora=True)
        results["lora_tiled"] = run(a.engine, f"{a.out}/lora_tiled", tiled=True, lora=True)
    if this_rank() == 0:
        with open(f"{a.out}/results.json", "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
