"""Steady-state speed of the ``fast`` preset vs the stock Trainer: ``hf-speedup bench`` with this file's defaults.

    python benchmarks/bench_fast.py                                  # stock vs fast, 60 lock-stepped steps each
    python benchmarks/bench_fast.py --stock-compile                  # + stock TrainingArguments(torch_compile=True)
    python benchmarks/bench_fast.py --variants stock,fast,fast:compile.mode=None   # ablations
    python benchmarks/bench_fast.py --variants stock,fast,floor      # + the exact-fp32 floor (step_floor.py)

Model and data: the embedded tiny Llama (``hf_speedup.tiny`` default sizes: 4 blocks, hidden 256, vocab 512),
fp32, batch 8 x 128 tokens (``--data fixed``: every row 128 real tokens), the same rows for every variant.

The measurement is the product's own (``hf_speedup.bench``): every variant a Trainer in a fresh worker
process with an empty compile cache, set up one at a time (its cold start: process start to the end of
step 1), then run in lock step (step i of each variant back to back while the others wait). Read the
median of the per-step ratios to stock, with its interquartile range. ``floor`` is a custom variant of
that harness (``step_floor.floor_variant``): the step's GEMMs and attention alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository, when hf_speedup is not installed

CUSTOM = {"floor": os.path.join(HERE, "step_floor.py") + ":floor_variant"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="stock,fast",
                   help="comma list: 'stock', 'stock-compile' (TrainingArguments.torch_compile=True), any other "
                        "peer of hf-speedup bench, a preset name, PRESET:section.field=value[:...] (e.g. "
                        "fast:compile.mode=None), or 'floor' (the step's GEMMs and attention alone: the ceiling of "
                        "any exact-fp32 speed-up, step_floor.py)")
    p.add_argument("--steps", type=int, default=60, help="measured steps per variant (lock-stepped)")
    p.add_argument("--warmup", type=int, default=5, help="steps run before measuring (compile happens here)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--data", default="fixed", help="fixed (default), ragged or a file, as hf-speedup bench --data")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--stock-compile", action="store_true", help="also run stock TrainingArguments(torch_compile=True)")
    p.add_argument("--cold-start", action="store_true",
                   help="kept for the commands recorded in RESULTS.md: every run now measures the cold start")
    p.add_argument("--json", default=None, help="also copy bench.json here")
    p.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "hf_speedup_bench_fast"))
    return p.parse_args(argv)


def options(argv=None):
    """The bench options this script stands for (``--steps`` counts measured steps, after ``--warmup``)."""
    from hf_speedup.bench import BenchOptions

    a = parse_args(argv)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    if a.stock_compile and "stock-compile" not in variants:
        variants.append("stock-compile")
    command = "python " + " ".join(shlex.quote(x) for x in ["benchmarks/bench_fast.py", *(argv or sys.argv[1:])])
    return BenchOptions(tiny=True, variants=variants, steps=a.warmup + a.steps, warmup=a.warmup,
                        batch_size=a.batch_size, seq_len=a.seq_len, data=a.data, threads=a.threads,
                        output=a.output_dir, custom={k: v for k, v in CUSTOM.items() if k in variants},
                        command=command)


def main(argv=None) -> dict:
    from hf_speedup.bench import run_bench

    a = parse_args(argv)
    result = run_bench(options(argv))
    print()
    print(result.text())
    for entry in result.variants:
        info = (entry.get("worker") or {}).get("info") or {}
        if "ceiling_reason" in info:
            print(f"  {entry['name']} ceiling: {info['ceiling_reason']}")
    report = result.to_dict()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=2, default=str)
    return report


if __name__ == "__main__":
    main()
