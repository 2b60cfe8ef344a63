"""What a checkpoint costs the training loop: the seconds each save blocks it, stock Trainer against ours, on a
SmolLM2-135M full fine-tune (fp32 weights; a checkpoint with the optimizer is ~1.6 GB).

    python benchmarks/smollm2_dir.py /tmp/smollm2
    python benchmarks/async_save.py --model /tmp/smollm2 --steps 40 --save-steps 10

One process per variant, one after the other (nothing else running): ``stock`` (transformers' Trainer), ``sync``
(``fast`` with ``crash_safe.asynchronous: false``: staged, fsync'ed, renamed, the Trainer waiting) and ``async``
(``fast`` with ``asynchronous: true``: the state copied to host memory, the files written by a background thread;
``fast``'s ``auto`` picks it on a GPU host or where training leaves CPU cores idle, ``sync`` where it does not). Each trains ``--steps``
steps of 2 rows x 128 tokens and saves every ``--save-steps``. Blocked: the wall time of ``_save_checkpoint`` on the
training thread (for ``async`` that includes waiting for the previous save, if it were still being written). Beside
a write: the median step that ran while a background write was in flight, against the median of the others (what
the writer thread takes from training: the GIL, memory bandwidth, the 2 cores). Goodput, the same for every variant: the seconds
inside optimizer steps (``on_step_begin`` to ``on_step_end``) less dynamo's compiling, over the seconds since the
process started (the report's own figure is printed beside it for ours). Each variant's train() wall clock includes its own compile (``fast`` compiles once it pays back).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_models import load_model, parser  # noqa: E402
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

VARIANTS = {"stock": None, "sync": {"base": "fast", "crash_safe": {"asynchronous": False}},
            "async": {"base": "fast", "crash_safe": {"asynchronous": True}}}


def one_run(model_dir: str, variant: str, steps: int, save_steps: int, out: str, cuda: bool = False) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_speedup import SpeedupMixin
    from hf_speedup.tiny import causal_lm_collator, char_tokenizer, make_rows

    from hf_speedup.report.measure.dynamo_counters import compile_seconds

    blocked: list[float] = []
    step_ends: list[tuple[int, float, bool]] = []  # (step, time, a background write in flight)
    productive = [0.0, 0.0]  # [step seconds less compiling, the last step's begin]

    class Timed:
        def _save_checkpoint(self, model, trial):
            start = time.perf_counter()
            super()._save_checkpoint(model, trial)
            blocked.append(time.perf_counter() - start)

    class Steps(TrainerCallback):
        def __init__(self, trainer_ref):
            self.trainer_ref = trainer_ref

        def on_step_begin(self, args, state, control, **kwargs):
            productive[1] = time.perf_counter() - compile_seconds()

        def on_step_end(self, args, state, control, **kwargs):
            productive[0] += time.perf_counter() - compile_seconds() - productive[1]
            writer = getattr(self.trainer_ref[0], "_speedup_background", None)
            step_ends.append((state.global_step, time.perf_counter(), bool(writer is not None and writer.busy)))

    tok = char_tokenizer()
    ds = make_rows(tok, n=2 * steps, seed=0, pack_to=128)
    model = load_model(model_dir, torch.float32)
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-5,
                             save_strategy="steps", save_steps=save_steps, save_total_limit=2, logging_steps=5,
                             report_to=[], use_cpu=not cuda, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    ref: list = [None]
    common = dict(model=model, args=args, train_dataset=ds, data_collator=causal_lm_collator(tok),
                  callbacks=[Steps(ref)])
    if VARIANTS[variant] is None:
        trainer = type("StockTimed", (Timed, Trainer), {})(**common)
    else:
        trainer = type("OursTimed", (Timed, SpeedupMixin, Trainer), {})(**common, speedup=VARIANTS[variant])
        trainer.speedup_callback.print_tables = False
    ref[0] = trainer
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    import psutil

    since_process_start = time.time() - psutil.Process().create_time()
    times = [(s, t1 - t0, busy) for (s, t1, busy), (_, t0, _) in zip(step_ends[1:], step_ends[:-1])]
    saving = {s for s in range(save_steps, steps + 1, save_steps)}
    beside = [d for s, d, busy in times if busy and s not in saving]
    others = [d for s, d, busy in times if not busy and s not in saving and s > 2]
    size = sum(f.stat().st_size for f in Path(out, f"checkpoint-{steps}").rglob("*") if f.is_file())
    row = {"variant": variant, "saves": len(blocked), "blocked": blocked, "wall": wall, "checkpoint_bytes": size,
           "beside_write_median": statistics.median(beside) if beside else None,
           "other_median": statistics.median(others) if others else None, "beside_steps": len(beside),
           "goodput": productive[0] / since_process_start, "process_seconds": since_process_start,
           "compile_seconds": compile_seconds()}
    status = getattr(trainer, "speedup_status", None)
    if status is not None:
        row["crash_safe"] = status["crash_safe"].to_dict()["settings"]
        metrics = trainer.speedup_report.to_dict().get("metrics", {})
        row["report"] = {k: metrics.get(k) for k in ("goodput", "wall_clock_seconds", "save_blocked_seconds",
                                                       "compile_seconds", "productive_step_seconds")}
    return row


def table(rows: list[dict]) -> str:
    stock = next((r for r in rows if r["variant"] == "stock"), None)
    lines = ["| variant | saves | median blocked s/save | x stock | total blocked s | train() wall s | goodput | "
             "median step beside a write s | median other step s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        med = statistics.median(r["blocked"])
        ratio = f"{med / statistics.median(stock['blocked']):.3f}" if stock else "-"
        fmt = (lambda v: f"{v:.3f}" if v is not None else "-")
        lines.append(f"| {r['variant']} | {r['saves']} | {med:.3f} | {ratio} | {sum(r['blocked']):.2f} | "
                     f"{r['wall']:.1f} | {r['goodput']:.3f} | {fmt(r['beside_write_median'])} ({r['beside_steps']}) | "
                     f"{fmt(r['other_median'])} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=10)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary folder)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        print("ROW " + json.dumps(one_run(a.model, a.one, a.steps, a.save_steps, a.out, a.cuda)))
        return 0
    rows = []
    for variant in a.variants:
        out = tempfile.mkdtemp(prefix=f"async_save_{variant}_", dir=a.dir)
        try:
            done = subprocess.run([sys.executable, __file__, "--model", a.model, "--one", variant, "--out", out,
                                   "--steps", str(a.steps), "--save-steps", str(a.save_steps)]
                                  + (["--cuda"] if a.cuda else []),
                                  capture_output=True, text=True)
        finally:
            shutil.rmtree(out, ignore_errors=True)
        row = next((json.loads(line[4:]) for line in done.stdout.splitlines() if line.startswith("ROW ")), None)
        if row is None:
            print(done.stderr[-4000:], file=sys.stderr)
            return 1
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
