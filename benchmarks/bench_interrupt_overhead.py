"""What preemption handling costs per optimizer step: the ``interrupt`` feature's step-end check timed in place.

    python benchmarks/bench_interrupt_overhead.py                                   # one process
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_interrupt_overhead.py  # two: + the rank agreement

The embedded tiny Llama (``hf_speedup.tiny`` default sizes, batch 8 x 128 tokens per process) trains with the
stock Trainer's setup plus the feature (``base: baseline, interrupt: {enabled: true}``). The time spent in the
feature's ``on_step_end`` (in two processes: one integer all-reduce over gloo) is accumulated with a host
clock, and compared with the step time measured in the same run (host clock between step ends). In two
processes a second all-reduce right after each check (the ranks are aligned then) measures the collective's
own cost apart from the wait for the slower rank. No signal is sent: this is the cost every uninterrupted step
pays. The handler itself runs only when a signal arrives.
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--output-dir", default="outputs/bench_interrupt_overhead")
    ns = p.parse_args(argv)

    from transformers import TrainerCallback, TrainingArguments

    from hf_speedup.callback_handler import all_callbacks
    from hf_speedup import SpeedupTrainer
    from hf_speedup.features.interrupt import InterruptCallback
    from hf_speedup.tiny import causal_lm_collator, char_tokenizer, make_dataset, tiny_llama

    tok = char_tokenizer()
    ds = make_dataset(tok, n=max(64, ns.steps * ns.batch_size * 2), seed=0, pack_to=ns.seq_len)
    args = TrainingArguments(output_dir=ns.output_dir, per_device_train_batch_size=ns.batch_size, max_steps=ns.steps,
                             logging_steps=10, report_to=[], use_cpu=True, save_strategy="no", seed=0,
                             disable_tqdm=True, dataloader_drop_last=True)
    step_ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    trainer = SpeedupTrainer(model=tiny_llama(seed=0), args=args, train_dataset=ds,
                             data_collator=causal_lm_collator(tok),
                             speedup={"base": "baseline", "interrupt": {"enabled": True}}, callbacks=[StepClock()])
    trainer.speedup_callback.print_tables = False
    feature = next(cb for cb in all_callbacks(trainer) if isinstance(cb, InterruptCallback))
    check_times: list[float] = []
    aligned_times: list[float] = []  # a second all-reduce right after the check: the ranks are aligned then
    inner = feature.on_step_end

    def timed(*a, **kw):
        t = time.perf_counter()
        out = inner(*a, **kw)
        check_times.append(time.perf_counter() - t)
        if feature.agreement is not None:
            t = time.perf_counter()
            feature.agreement.max(0)
            aligned_times.append(time.perf_counter() - t)
        return out

    feature.on_step_end = timed
    trainer.train()
    steps = [b - a for a, b in zip(step_ends, step_ends[1:])][ns.warmup:]
    checks = check_times[ns.warmup + 1:]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if int(os.environ.get("RANK", "0")) == 0:
        step, check = statistics.median(steps), statistics.median(checks)
        agreement = trainer.speedup_status["interrupt"].facts.get("agreement", "none (one process)")
        print(f"command: {shlex.join([os.path.basename(sys.argv[0]), *sys.argv[1:]])} (world size {world})")
        print(f"rank agreement: {agreement}")
        print(f"median step time     {step * 1e3:9.2f} ms   ({len(steps)} steps)")
        p90 = statistics.quantiles(checks, n=10)[-1]
        print(f"median step-end check {check * 1e6:8.1f} us   (p90 {p90 * 1e6:.1f} us)")
        print(f"overhead             {check / step:9.4%} of a step")
        if aligned_times:
            aligned = statistics.median(aligned_times[ns.warmup + 1:])
            print(f"of which the all-reduce itself, ranks aligned: {aligned * 1e6:.1f} us ({aligned / step:.4%} of a "
                  "step); the rest of the check is this rank waiting for the slower one to reach its step end")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown, where gloo can abort a finished process (see tests/dist)
