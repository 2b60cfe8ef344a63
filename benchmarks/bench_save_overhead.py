"""What crash-safe checkpoints cost per save: the stock Trainer's ``_save_checkpoint`` against ``baseline``'s
(staging folder, fsync of every file and folder, rename), timed in turns in one process.

    python benchmarks/bench_save_overhead.py --hidden 512 --layers 8 --reps 6

One Llama built from a config (``--hidden``, ``--layers``), one optimizer step so that AdamW has its state,
then ``--reps`` saves by each trainer in alternation (stock, ours, stock, ...), each into its own empty
folder (no rotation). The fsyncs wait for the disk to hold the bytes, which the stock Trainer leaves to the
kernel's writeback after ``_save_checkpoint`` returns: the difference is the price of durability on this disk.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    ns = p.parse_args(argv)

    from transformers import Trainer, TrainingArguments

    from hf_speedup import SpeedupTrainer
    from hf_speedup.tiny import causal_lm_collator, char_tokenizer, make_dataset, tiny_llama

    root = tempfile.mkdtemp(prefix="bench_save_", dir=ns.dir)
    tok = char_tokenizer()
    ds = make_dataset(tok, n=16, seed=0, pack_to=64)
    sizes = dict(hidden_size=ns.hidden, intermediate_size=ns.hidden * 11 // 4, num_hidden_layers=ns.layers,
                 num_attention_heads=max(1, ns.hidden // 64), num_key_value_heads=max(1, ns.hidden // 128))
    trainers = {}
    for name in ("stock", "ours"):
        args = TrainingArguments(output_dir=os.path.join(root, name), max_steps=1, per_device_train_batch_size=2,
                                 save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
        kw = dict(model=tiny_llama(seed=0, **sizes), args=args, train_dataset=ds, data_collator=causal_lm_collator(tok))
        trainer = Trainer(**kw) if name == "stock" else SpeedupTrainer(**kw, speedup="baseline")
        if name == "ours":
            trainer.speedup_callback.print_tables = False
        trainer.train()  # one step: the optimizer has its state, as in any real save
        trainers[name] = trainer
    params = sum(p.numel() for p in trainers["stock"].model.parameters())
    times: dict[str, list[float]] = {"stock": [], "ours": []}
    for rep in range(ns.reps):
        for name, trainer in trainers.items():
            trainer.state.global_step = 1000 + rep  # a new checkpoint-N each time
            start = time.perf_counter()
            trainer._save_checkpoint(trainer.model, trial=None)
            times[name].append(time.perf_counter() - start)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(root, "stock",
                                                                                         "checkpoint-1000"))
               for f in fs)
    shutil.rmtree(root, ignore_errors=True)
    stock, ours = statistics.median(times["stock"]), statistics.median(times["ours"])
    print(f"model: {params / 1e6:.1f}M parameters; checkpoint {size / 2**20:.0f} MiB; {ns.reps} saves each")
    print("| trainer | median save s | all saves s |")
    print("|---|---|---|")
    for name, label in (("stock", "stock Trainer"), ("ours", "baseline (staged, fsync'ed, renamed)")):
        print(f"| {label} | {statistics.median(times[name]):.3f} | {', '.join(f'{t:.2f}' for t in times[name])} |")
    print(f"ours - stock: {ours - stock:+.3f} s per save ({ours / stock:.2f}x)")


if __name__ == "__main__":
    main()
