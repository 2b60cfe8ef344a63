"""Steady-state speed of the ``fast`` preset vs the stock Trainer, side by side in one process.

    python benchmarks/bench_fast.py                          # stock vs fast, 8 interleaved rounds
    python benchmarks/bench_fast.py --cold-start             # + first-step time of each, fresh processes
    python benchmarks/bench_fast.py --cold-start --stock-compile   # + stock TrainingArguments(torch_compile=True)
    python benchmarks/bench_fast.py --variants stock,fast,fast:compile.mode=None   # ablations

Model and data: the embedded tiny Llama (``hf_speedup.tiny`` default sizes: 4 blocks, hidden 256, vocab 512),
fp32, batch 8 x 128 tokens (``make_dataset(tok, pack_to=128)``), the same collator for every variant.

Steady state: every variant is a real Trainer; each round calls ``train()`` on each variant in turn
(round-robin, so machine drift hits all alike), and the time between consecutive step ends is recorded
after ``--warmup`` steps of each call. Reported per variant: median step time over all rounds, and the
median over rounds of the per-round ratio to ``stock`` (the robust number on a shared machine).

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
                        "name, or PRESET:section.field=value[:...] (e.g. fast:compile.mode=None)")
    p.add_argument("--rounds", type=int, default=8, help="interleaved rounds (train() calls per variant)")
    p.add_argument("--steps", type=int, default=8, help="measured steps per round")
    p.add_argument("--warmup", type=int, default=2, help="steps excluded at the start of each train() call")
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
def data(seq_len: int):
    from hf_speedup.tiny import causal_lm_collator, char_tokenizer, make_dataset

    tok = char_tokenizer()
    return make_dataset(tok, n=2048, seed=0, pack_to=seq_len), causal_lm_collator(tok)


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


class StepClock:
    """Host-clock time at every step end (the same callback in every variant)."""

    def __init__(self):
        from transformers import TrainerCallback

        clock = self
        self.stamps: list[float] = []
        self.started = 0.0

        class _CB(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                clock.stamps = []
                clock.started = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                clock.stamps.append(time.perf_counter())

        self.callback = _CB()

    def intervals(self, skip: int) -> list[float]:
        s = self.stamps
        return [b - a for a, b in zip(s[skip:], s[skip + 1:])]


def build(spec: str, dataset, collator, args_kw: dict, out: str):
    """One Trainer per variant, each on its own freshly built (identical) model."""
    from transformers import Trainer, TrainingArguments

    from hf_speedup import SpeedupTrainer, get_preset
    from hf_speedup.tiny import tiny_llama

    clock = StepClock()
    model = tiny_llama(seed=0)
    name, edits = parse_variant(spec)
    args = TrainingArguments(output_dir=os.path.join(out, spec.replace(":", "_").replace("=", "-")),
                             torch_compile=(name == "stock-compile"), **args_kw)
    common = dict(model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[clock.callback])
    if name in ("stock", "stock-compile"):
        return Trainer(**common), clock
    cfg = get_preset(name).replace(**edits) if edits else name
    return SpeedupTrainer(**common, speedup=cfg), clock


def training_kwargs(a) -> dict:
    return dict(per_device_train_batch_size=a.batch_size, max_steps=a.warmup + a.steps + 1, use_cpu=True,
                report_to=[], save_strategy="no", logging_steps=10**6, disable_tqdm=True, seed=0,
                dataloader_num_workers=0)


def quietly(fn):
    """Run ``fn`` with the per-run console output (plan tables, summaries) swallowed."""
    with contextlib.redirect_stdout(io.StringIO()):
        return fn()


# --------------------------------------------------------------------------------------------- measure
def steady_state(a) -> dict:
    dataset, collator = data(a.seq_len)
    specs = a.variants.split(",")
    runs = {s: build(s, dataset, collator, training_kwargs(a), a.output_dir) for s in specs}
    first = {}
    for s, (trainer, clock) in runs.items():  # round 0: compiles happen here, not measured
        t0 = time.perf_counter()
        quietly(trainer.train)
        first[s] = clock.stamps[0] - clock.started if clock.stamps else float("nan")
        print(f"  warm-up {s}: first step {first[s]:.1f}s, whole call {time.perf_counter() - t0:.1f}s", flush=True)
    per_round: dict[str, list[float]] = {s: [] for s in specs}
    every: dict[str, list[float]] = {s: [] for s in specs}
    for r in range(a.rounds):
        for s, (trainer, clock) in runs.items():
            quietly(trainer.train)
            iv = clock.intervals(a.warmup)
            per_round[s].append(statistics.median(iv))
            every[s].extend(iv)
        print(f"  round {r + 1}/{a.rounds}: " + "  ".join(f"{s} {per_round[s][-1] * 1e3:.0f} ms" for s in specs),
              flush=True)
    base = specs[0]
    result = {}
    for s in specs:
        ratios = [b / x for b, x in zip(per_round[base], per_round[s])]
        ts = sorted(every[s])
        result[s] = dict(step_ms_median=1e3 * statistics.median(ts), step_ms_p10=1e3 * ts[len(ts) // 10],
                         step_ms_p90=1e3 * ts[(9 * len(ts)) // 10], steps_per_s=1 / statistics.median(ts),
                         speedup_median_of_round_ratios=statistics.median(ratios),
                         speedup_of_medians=statistics.median(every[base]) / statistics.median(ts),
                         round_ratios=ratios, first_step_s_in_process=first[s])
        trainer = runs[s][0]
        if hasattr(trainer, "speedup_report"):
            result[s]["plan"] = {k: f"{v['applied']} (engaged={v['engaged']})"
                                 for k, v in trainer.speedup_report.to_dict()["plan"].items()}
            result[s]["compile_reason"] = trainer.speedup_report.to_dict()["plan"]["compile"]["reason"]
    return result


def first_step_child(spec: str, a) -> None:
    """In a fresh process: build, train one step, print the first-step seconds as JSON."""
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    dataset, collator = data(a.seq_len)
    kw = training_kwargs(a) | {"max_steps": 1}
    trainer, clock = build(spec, dataset, collator, kw, a.output_dir)
    quietly(trainer.train)
    print(json.dumps({"first_step_s": clock.stamps[0] - clock.started}))


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

    from hf_speedup.hardware import _cpu_name

    return dict(cpu=_cpu_name(), cores=os.cpu_count(), torch_threads=torch.get_num_threads(),
                torch=torch.__version__, transformers=transformers.__version__, python=platform.python_version(),
                loadavg=os.getloadavg())


def print_table(res: dict, base: str) -> None:
    print(f"\n{'variant':<34} {'steps/s':>8} {'step ms':>8} {'p10-p90 ms':>13} {'x ' + base + ' (rounds)':>18}"
          f" {'x (medians)':>11}")
    for s, r in res.items():
        print(f"{s:<34} {r['steps_per_s']:8.2f} {r['step_ms_median']:8.1f} "
              f"{r['step_ms_p10']:6.1f}-{r['step_ms_p90']:<6.1f} {r['speedup_median_of_round_ratios']:18.2f}"
              f" {r['speedup_of_medians']:11.2f}")


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
        if "compile_reason" in r:
            print(f"  {s} compile: {r['compile_reason']}")
    if a.cold_start:
        specs = [s for s in a.variants.split(",") if s != "stock-compile"]
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
