"""Reporting overhead: SpeedupTrainer with its report on vs off, side by side in one process.

    python benchmarks/bench_report_overhead.py                 # embedded tiny Llama, default sizes
    python benchmarks/bench_report_overhead.py --steps 60 --repeats 5 --logging-steps 1

Two measurements, both on the embedded model (``hf_speedup.tiny`` default sizes, batch 8 x 128 tokens):

1. direct: the time spent inside the reporting code itself (token counting per micro-batch, the step
   hook, the logging-step hook), accumulated with a host clock and divided by the step time. This is
   the overhead, free of machine noise.
2. side by side: median steady-state step time of runs with the report on and off, interleaved
   (on, off, on, off, ...) so that machine drift hits both alike. On a shared CPU this difference is
   dominated by noise; its spread is printed with it.

The run passes when the direct overhead is below 1% of the step time. The report reads the device only
at logging steps (where the Trainer itself synchronises) - ``tests/test_report.py`` checks that.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=3, help="steps excluded from each run's median")
    p.add_argument("--repeats", type=int, default=3, help="runs per mode (interleaved)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--logging-steps", type=int, default=10)
    p.add_argument("--output-dir", default="outputs/bench_report_overhead")
    return p.parse_args(argv)


class StepClock:
    """Independent step timer present in both modes (host clock at each step end)."""

    def __init__(self):
        from transformers import TrainerCallback

        clock = self

        class _CB(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                clock.last = time.perf_counter()
                clock.times = []

            def on_step_end(self, args, state, control, **kw):
                now = time.perf_counter()
                clock.times.append(now - clock.last)
                clock.last = now

        self.callback = _CB()
        self.times: list[float] = []
        self.last = 0.0


def instrument(callback) -> dict:
    """Wrap the reporting hooks with accumulating host timers; returns the accumulator."""
    acc = {"per_step": 0.0, "per_log": 0.0, "begin_end": 0.0, "batches": 0, "logs": 0}

    def wrap(name, bucket, counter=None):
        orig = getattr(callback, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                acc[bucket] += time.perf_counter() - t0
                if counter:
                    acc[counter] += 1

        setattr(callback, name, timed)

    wrap("count_batch", "per_step", "batches")
    wrap("on_step_end", "per_step")
    wrap("augment_logs", "per_log", "logs")
    wrap("on_train_begin", "begin_end")
    wrap("on_train_end", "begin_end")
    return acc


def run_once(ns, report_on: bool, run_idx: int, data, collator):
    from transformers import TrainingArguments

    from hf_speedup import SpeedupTrainer
    from hf_speedup.tiny import tiny_llama

    clock = StepClock()
    args = TrainingArguments(
        output_dir=os.path.join(ns.output_dir, f"{'on' if report_on else 'off'}-{run_idx}"),
        per_device_train_batch_size=ns.batch_size, max_steps=ns.steps, logging_steps=ns.logging_steps,
        report_to=[], use_cpu=True, save_strategy="no", seed=0, dataloader_num_workers=0, disable_tqdm=True,
        log_level="error")
    trainer = SpeedupTrainer(model=tiny_llama(seed=0), args=args, train_dataset=data, data_collator=collator,
                             speedup="baseline", callbacks=[clock.callback])
    acc = None
    if report_on:
        trainer.speedup_callback.print_tables = False
        acc = instrument(trainer.speedup_callback)
    else:
        trainer.remove_callback(trainer.speedup_callback)
        trainer.speedup_callback = None
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's per-log print lines
        trainer.train()
    steady = clock.times[ns.warmup:] or clock.times
    return statistics.median(steady), acc, len(clock.times)


def main(argv=None) -> int:
    ns = parse_args(argv)
    import torch

    from hf_speedup.tiny import TINY_SIZES, causal_lm_collator, char_tokenizer, make_dataset

    tok = char_tokenizer()
    n_rows = ns.steps * ns.batch_size + ns.batch_size
    data = make_dataset(tok, n=n_rows * (ns.seq_len // 12 + 1), seed=0, pack_to=ns.seq_len)
    collator = causal_lm_collator(tok)
    cmd = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    print(f"command: {cmd}")
    print(f"model: embedded tiny Llama {TINY_SIZES}; batch {ns.batch_size} x {ns.seq_len} tokens; "
          f"{ns.steps} steps/run ({ns.warmup} warm-up), logging every {ns.logging_steps}; "
          f"{ns.repeats} runs per mode, interleaved; torch {torch.__version__}, {torch.get_num_threads()} threads")

    on, off, direct = [], [], []
    for r in range(ns.repeats):
        for mode in (True, False) if r % 2 == 0 else (False, True):
            med, acc, steps = run_once(ns, mode, r, data, collator)
            (on if mode else off).append(med)
            if acc is not None:
                per_step_hooks = (acc["per_step"] + acc["per_log"]) / steps
                direct.append((per_step_hooks, acc, med, steps))
            print(f"  run {r + 1} report {'on ' if mode else 'off'}: median step {med * 1000:8.2f} ms")

    hook_s = statistics.median(d[0] for d in direct)
    step_s = statistics.median(on)
    ratio = hook_s / step_s
    acc = direct[-1][1]
    print()
    print(f"direct   : reporting code {hook_s * 1e6:8.1f} us per step "
          f"(counting {acc['batches']} batches + step hooks + {acc['logs']} logging-step hooks, "
          f"last run {acc['per_step'] * 1e3:.2f} + {acc['per_log'] * 1e3:.2f} ms); one-off begin/end "
          f"{acc['begin_end'] * 1e3:.1f} ms per run")
    print(f"           step time {step_s * 1000:.2f} ms -> overhead {100 * ratio:.3f}% of step time")
    m_on, m_off = statistics.median(on), statistics.median(off)
    spread = (max(on + off) - min(on + off)) / m_off
    print(f"side-by-side: median step on {m_on * 1000:.2f} ms, off {m_off * 1000:.2f} ms -> "
          f"{100 * (m_on - m_off) / m_off:+.2f}% (run-to-run spread {100 * spread:.1f}%: noise of this machine)")
    ok = ratio < 0.01
    print(f"RESULT: reporting overhead {100 * ratio:.3f}% {'<' if ok else '>='} 1% of step time -> "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
