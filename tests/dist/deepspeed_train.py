"""Two processes under DeepSpeed ZeRO (gloo on CPU): the stock Trainer, then SpeedupTrainer with each preset given,
on the same tiny model, data and DeepSpeed config; with ``--resume`` each preset also saves every 2 steps and a
second trainer resumes from checkpoint-2. Rank 0 writes what each run did (losses by step, the report's entries,
the live engine) to ``--out``."""

from __future__ import annotations

import argparse
import json
import os

import dist_common  # noqa: F401  (before transformers: the checkout importable, the offline environment)
from dist_common import GLOBAL_BATCH, MODEL, this_rank, world_size


def run(config: str, preset: str | None, out_dir: str, save: bool = False, resume: str | None = None) -> dict:
    import torch
    from transformers import Trainer, TrainingArguments

    import hf_speedup.hardware as hardware
    from hf_speedup import SpeedupTrainer
    from hf_speedup.tiny import causal_lm_collator, char_tokenizer, make_rows, tiny_llama

    # fp32 on every CPU: the presets' losses are compared with the fp32 stock Trainer's (on an AMX CPU auto picks bf16)
    hardware._cpu_bf16 = lambda: (False, "faked for the test: fp32 on every CPU")

    tok = char_tokenizer()
    rows = make_rows(tok, n=64, seed=0, pack_to=32)
    args = TrainingArguments(output_dir=out_dir, use_cpu=True, deepspeed=config, max_steps=4, logging_steps=1,
                             per_device_train_batch_size=GLOBAL_BATCH // world_size(), report_to=[],
                             save_strategy="steps" if save else "no", save_steps=2, seed=0, disable_tqdm=True)
    kw = dict(model=tiny_llama(seed=0, **MODEL), args=args, train_dataset=rows, data_collator=causal_lm_collator(tok))
    trainer = Trainer(**kw) if preset is None else SpeedupTrainer(**kw, speedup=preset)
    trainer.train(resume_from_checkpoint=resume)
    res = {"losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
           "deepspeed_enabled": trainer.is_deepspeed_enabled,
           "world_size": torch.distributed.get_world_size(),
           "stage": trainer.model_wrapped.zero_optimization_stage()}
    if preset is not None:
        report = trainer.speedup_report.to_dict()
        res["plan"] = {k: report["plan"][k] for k in ("deepspeed", "compile", "optimizer", "precision", "crash_safe")}
        res["metrics"] = {k: report["metrics"][k] for k in ("recompiles", "graph_breaks")}
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--presets", nargs="*", default=["auto"])
    p.add_argument("--out", required=True)
    p.add_argument("--resume", action="store_true", help="also: each preset saved every 2 steps, resumed from step 2")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    results = {"stock": run(a.config, None, f"{a.out}/stock")}
    for preset in a.presets:
        results[preset] = run(a.config, preset, f"{a.out}/{preset}", save=a.resume)
        if a.resume:
            folder = f"{a.out}/{preset}"
            results[f"{preset}:resumed"] = run(a.config, preset, folder, save=True, resume=f"{folder}/checkpoint-2")
            results[f"{preset}:resumed"]["checkpoint"] = sorted(os.listdir(f"{folder}/checkpoint-2"))
    if this_rank() == 0:
        with open(f"{a.out}/results.json", "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
