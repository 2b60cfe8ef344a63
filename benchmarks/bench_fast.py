"""Steady-state speed of the ``fast`` preset vs the stock Trainer, side by side in one run.

    python benchmarks/bench_fast.py                          # stock vs fast, 60 lock-stepped steps each
    python benchmarks/bench_fast.py --cold-start             # + first-step time of each, fresh processes
    python benchmarks/bench_fast.py --cold-start --stock-compile   # + stock TrainingArguments(torch_compile=True)
    python benchmarks/bench_fast.py --variants stock,fast,fast:compile.mode=None   # ablations
    python benchmarks/bench_fast.py --variants stock,fast,floor   # + the exact-fp32 floor (step_floor.py)

Model and data: the embedded tiny Llama (``hf_speedup.tiny`` default sizes: 4 blocks, hidden 256, vocab 512),
fp32, batch 8 x 128 tokens (``make_dataset(tok, pack_to=128)``), the same collator for every variant.

Steady state: every variant is a real Trainer in its own worker process (so process-wide settings, such
as the CPU allocator, belong to the variant that asked for them). The workers run in lock step: step i of
each variant runs back to back while the others wait, so drift of this shared machine hits all alike.
Reported per variant: the median step time, and the median over steps of the per-step ratio to the first
variant (with its interquartile range): the robust number on a shared machine.

Cold start: each variant in a fresh process with an empty inductor cache (``TORCHINDUCTOR_CACHE_DIR`` under
/tmp), from ``train()`` to the end of the first step; compile cost is included, warm caches are not.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="stock,fast",
                   help="comma list: 'stock', 'stock-compile' (TrainingArguments.torch_compile=True), a preset "
                        "name, PRESET:section.field=value[:...] (e.g. fast:compile.mode=None), or 'floor' (the "
                        "step's GEMMs and attention alone: the ceiling of any exact-fp32 speed-up, step_floor.py)")
    p.add_argument("--steps", type=int, default=60, help="measured steps per variant (lock-stepped)")
    p.add_argument("--warmup", type=int, default=5, help="steps run before measuring (compile happens here)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    p.add_argument("--cold-start", action="store_true", help="also time the first step in fresh processes")
    p.add_argument("--stock-compile", action="store_true",
                   help="with --cold-start: also time stock TrainingArguments(torch_compile=True)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--output-dir", default=os.path.join(tempfile.gettempdir(), "hf_speedup_bench_fast"))
    p.add_argument("--first-step-only", default=None, help=argparse.SUPPRESS)  # child process of --cold-start
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------- setup
def data(seq_len: int, batch_size: int):
    """Packed rows, cut to a whole number of batches: every variant sees only full batches (same shapes)."""
    from hf_speedup.tiny import causal_lm_collator, char_tokenizer, make_dataset

    tok = char_tokenizer()
    rows = make_dataset(tok, n=2048, seed=0, pack_to=seq_len)
    return rows.select(range(len(rows) - len(rows) % batch_size)), causal_lm_collator(tok)


def parse_variant(spec: str) -> tuple[str, dict]:
    """'fast:compile.mode=None:data.pad_to_multiple_of=8' -> ('fast', {'compile': {'mode': None}, ...})."""
    import yaml

    name, *edits = spec.split(":")
    sections: dict = {}
    for edit in edits:
        key, value = edit.split("=", 1)
        section, field = key.split(".", 1)
        sections.setdefault(section, {})[field] = yaml.safe_load(value) if value != "None" else None
    return name, sections


class Lockstep:
    """Callback that runs one step per "go" from the parent and answers with that step's seconds.

    Time runs from the "go" to the end of ``on_step_end``: the rest of the previous loop iteration
    (logging/saving checks), fetching and collating the batch, forward, backward, optimizer step.
    """

    def __init__(self, conn):
        from transformers import TrainerCallback

        outer = self

        class _CB(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                outer.wait()

            def on_step_end(self, args, state, control, **kw):
                outer.step_done()

        self.conn, self.callback, self.go, self.faults = conn, _CB(), 0.0, 0

    def step_done(self) -> None:
        """Send this step's seconds and page faults, then wait for the next go."""
        r = resource.getrusage(resource.RUSAGE_SELF)
        self.conn.send((time.perf_counter() - self.go, r.ru_minflt - self.faults))
        self.wait()

    def wait(self) -> None:
        self.conn.recv()
        self.faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self.go = time.perf_counter()


def build(spec: str, dataset, collator, args_kw: dict, out: str, callbacks=()):
    """A Trainer for one variant on a freshly built (identical) model."""
    from transformers import Trainer, TrainingArguments

    from hf_speedup import SpeedupTrainer, get_preset
    from hf_speedup.tiny import tiny_llama

    model = tiny_llama(seed=0)
    name, edits = parse_variant(spec)
    args = TrainingArguments(output_dir=os.path.join(out, spec.replace(":", "_").replace("=", "-")),
                             torch_compile=(name == "stock-compile"), **args_kw)
    common = dict(model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=list(callbacks))
    if name in ("stock", "stock-compile"):
        return Trainer(**common)
    cfg = get_preset(name).replace(**edits) if edits else name
    return SpeedupTrainer(**common, speedup=cfg)


def training_kwargs(a, steps: int) -> dict:
    return dict(per_device_train_batch_size=a.batch_size, max_steps=steps, use_cpu=True, report_to=[],
                save_strategy="no", logging_steps=10**6, disable_tqdm=True, seed=0, dataloader_num_workers=0)


def quietly(fn):
    """Run ``fn`` with the per-run console output (plan tables, summaries) swallowed."""
    with contextlib.redirect_stdout(io.StringIO()):
        return fn()


# --------------------------------------------------------------------------------------------- measure
def worker(spec: str, a, conn) -> None:
    """One variant in its own process (process-wide settings such as the CPU allocator stay its own)."""
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    dataset, collator = data(a.seq_len, a.batch_size)
    clock = Lockstep(conn)
    if spec == "floor":
        return floor_worker(a, dataset, collator, clock)
    trainer = build(spec, dataset, collator, training_kwargs(a, a.warmup + a.steps), a.output_dir, [clock.callback])
    quietly(trainer.train)
    info = {}
    if hasattr(trainer, "speedup_report"):
        plan = trainer.speedup_report.to_dict()["plan"]
        info["plan"] = {k: f"{v['applied']} (engaged={v['engaged']})" for k, v in plan.items()}
        info["compile_reason"] = plan["compile"]["reason"]
        info["allocator_reason"] = plan["empty_cache"]["reason"]
    conn.send(("done", info))


def floor_worker(a, dataset, collator, clock) -> None:
    """The ``floor`` variant: per lock-step, the step's GEMMs and attention kernels alone (step_floor.py)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from step_floor import Floor

    floor = Floor(dataset, collator, a.batch_size, a.seq_len)
    clock.wait()
    for _ in range(a.warmup + a.steps):
        floor()
        clock.step_done()
    clock.conn.send(("done", floor.info(skip=a.warmup)))


def steady_state(a) -> dict:
    """Lock-stepped worker processes: step i of every variant runs back to back, alone on the machine."""
    import multiprocessing as mp

    specs = a.variants.split(",")
    ctx = mp.get_context("spawn")
    conns, procs = {}, {}
    for s in specs:
        parent, child = ctx.Pipe()
        procs[s] = ctx.Process(target=worker, args=(s, a, child), daemon=True)
        procs[s].start()
        conns[s] = parent
    times: dict[str, list[float]] = {s: [] for s in specs}
    faults: dict[str, list[int]] = {s: [] for s in specs}
    for i in range(a.warmup + a.steps):
        for s in specs:
            conns[s].send("go")
            seconds, minflt = conns[s].recv()
            times[s].append(seconds)
            faults[s].append(minflt)
        if i < a.warmup:
            print(f"  warm-up step {i + 1}: " + "  ".join(f"{s} {times[s][-1]:.1f}s" for s in specs), flush=True)
        elif (i - a.warmup + 1) % 10 == 0:
            print(f"  step {i - a.warmup + 1}/{a.steps}: "
                  + "  ".join(f"{s} {1e3 * statistics.median(times[s][a.warmup:]):.0f} ms" for s in specs), flush=True)
    info = {}
    for s in specs:
        conns[s].send("go")
        _, info[s] = conns[s].recv()
        procs[s].join(timeout=60)
    base = specs[0]
    result = {}
    for s in specs:
        steady, ts = times[s][a.warmup:], sorted(times[s][a.warmup:])
        ratios = sorted(b / x for b, x in zip(times[base][a.warmup:], steady))
        result[s] = dict(step_ms_median=1e3 * statistics.median(ts), step_ms_p10=1e3 * ts[len(ts) // 10],
                         step_ms_p90=1e3 * ts[(9 * len(ts)) // 10], steps_per_s=1 / statistics.median(ts),
                         speedup_median_of_step_ratios=statistics.median(ratios),
                         speedup_ratio_p25_p75=(ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]),
                         speedup_of_medians=statistics.median(times[base][a.warmup:]) / statistics.median(ts),
                         page_faults_per_step=statistics.median(faults[s][a.warmup:]),
                         first_step_s_in_process=times[s][0], **info[s])
    return result


def first_step_child(spec: str, a) -> None:
    """In a fresh process: build, train one step, print the first-step seconds as JSON."""
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    dataset, collator = data(a.seq_len, a.batch_size)
    stamps = []

    from transformers import TrainerCallback

    class _First(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            stamps.append(time.perf_counter())

    trainer = build(spec, dataset, collator, training_kwargs(a, 1), a.output_dir, [_First()])
    quietly(trainer.train)
    print(json.dumps({"first_step_s": stamps[1] - stamps[0]}))


def cold_start(a, specs: list[str]) -> dict:
    out = {}
    for spec in specs:
        with tempfile.TemporaryDirectory(prefix="hf_speedup_inductor_") as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=os.path.join(cache, "triton"))
            cmd = [sys.executable, __file__, "--first-step-only", spec, "--seq-len", str(a.seq_len),
                   "--batch-size", str(a.batch_size)] + (["--threads", str(a.threads)] if a.threads else [])
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
        line = next((ln for ln in proc.stdout.splitlines()[::-1] if ln.startswith("{")), None)
        if proc.returncode or line is None:
            out[spec] = {"error": (proc.stderr or proc.stdout)[-2000:]}
        else:
            out[spec] = {**json.loads(line), "process_wall_s": wall}
        print(f"  cold start {spec}: {out[spec].get('first_step_s', float('nan')):.1f}s first step "
              f"(process {wall:.0f}s)", flush=True)
    return out


# --------------------------------------------------------------------------------------------- report
def machine() -> dict:
    import torch
    import transformers

    from hf_speedup.hardware import cpu_name

    return dict(cpu=cpu_name(), cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                torch=torch.__version__, transformers=transformers.__version__, python=platform.python_version(),
                loadavg=os.getloadavg())


def print_table(res: dict, base: str) -> None:
    print(f"\n{'variant':<30} {'steps/s':>7} {'step ms':>8} {'p10-p90 ms':>12} {'x ' + base + ' (pairs)':>15}"
          f" {'p25-p75':>10} {'x (medians)':>11} {'faults/step':>11}")
    for s, r in res.items():
        lo, hi = r["speedup_ratio_p25_p75"]
        print(f"{s:<30} {r['steps_per_s']:7.2f} {r['step_ms_median']:8.1f} "
              f"{r['step_ms_p10']:5.0f}-{r['step_ms_p90']:<6.0f} {r['speedup_median_of_step_ratios']:15.2f}"
              f" {lo:4.2f}-{hi:<4.2f} {r['speedup_of_medians']:11.2f} {r['page_faults_per_step']:11.0f}")


def main(argv=None) -> dict:
    a = parse_args(argv)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    if a.first_step_only:
        first_step_child(a.first_step_only, a)
        return {}
    command = "python " + " ".join(shlex.quote(x) for x in [os.path.relpath(__file__)] + sys.argv[1:])
    info = machine()
    print(f"$ {command}\nmachine: {info}")
    report: dict = {"command": command, "machine": info}
    report["steady_state"] = steady_state(a)
    report["machine"]["loadavg_after"] = os.getloadavg()
    print_table(report["steady_state"], a.variants.split(",")[0])
    for s, r in report["steady_state"].items():
        for key in ("compile_reason", "allocator_reason", "ceiling_reason"):
            if key in r:
                print(f"  {s} {key.split('_')[0]}: {r[key]}")
    if a.cold_start:
        specs = [s for s in a.variants.split(",") if s not in ("stock-compile", "floor")]
        if a.stock_compile:
            specs.append("stock-compile")
        report["cold_start"] = cold_start(a, specs)
    print(f"load average before/after: {info['loadavg']} / {report['machine']['loadavg_after']} "
          f"(anything near or above {info['cores']} means the numbers are noisy)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=2, default=str)
    return report


if __name__ == "__main__":
    main()
