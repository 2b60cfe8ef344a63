"""``compile.when: pays_back`` against reality, on a real model and real-length chat rows.

Three whole runs of N steps, each a fresh process with an empty inductor cache, one after another:

  eager      the preset with compile.enabled: false (blocks never compiled)
  compiled   the preset with compile.when: always (blocks compiled from step 1)
  pays_back  the preset as it is (``fast`` on CPU: compile.when: pays_back; its verdict after step 3 is read
             from the report's notes)

Each run records the wall clock at the end of every step, from the start of its process (imports, model load,
trainer set-up included). From the timelines: the whole-run time at several run lengths for each; the steady
step of each (median of steps 4..N); the measured compile cost (the difference of the fixed parts: whole run
minus N steady steps, compiled minus eager) and per-step saving, so the measured payback step (cost / saving);
and beside them what pays_back's formula predicts with its constants (``PAYBACK`` in
``hf_speedup/features/compile/payback.py``: a gain fraction of the eager step and a cold-compile cost). The
compiled run's recompiles are counted twice: dynamo's per-frame compile counter and the report's ``recompiles``;
each frame compiled is listed, and dynamo's recompile reasons go to the run's log.

    python benchmarks/smollm2_dir.py /tmp/smollm2                     # the real model, once
    python benchmarks/payback_check.py --model /tmp/smollm2 --steps 40 --batch-size 2 --json payback.json
    python benchmarks/payback_check.py --model /tmp/smollm2 --precision bf16     # precision.dtype=bf16 edits
    python benchmarks/payback_check.py --model /tmp/smollm2 --edits fast:compile.mode=None ...

Data: ``--data docs-chat`` of hf-speedup bench (hf_speedup/bench/chat_data.py), the first steps x batch rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

START = time.perf_counter()  # this process's start, as near as Python gets
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUNS = {"eager": "compile.enabled=false", "compiled": "compile.when=always", "pays_back": None}


def spec_of(run: str, preset: str, precision: str | None, edits: list[str]) -> str:
    """The bench-style variant spec of one run: ``fast:compile.when=always:precision.dtype=bf16``."""
    parts = [preset] + ([RUNS[run]] if RUNS[run] else []) + edits
    if precision:
        parts.append(f"precision.dtype={precision}")
    return ":".join(parts)


def run_one(a) -> dict:
    """One whole run in this process; the wall clock at every step end, the report's compile facts."""
    sys.path.insert(0, ROOT)
    import torch
    from transformers import TrainerCallback, TrainingArguments

    if a.recompile_log:
        torch._logging.set_logs(recompiles=True, graph_breaks=True)
    from hf_speedup import SpeedupTrainer
    from hf_speedup.bench.chat_data import describe, rows_for_run
    from hf_speedup.bench.meters import TokenMeter
    from hf_speedup.bench.options import preset_config
    from hf_speedup.bench.variants import counting
    from hf_speedup.loading import load_model, load_tokenizer
    from hf_speedup.report.measure import dynamo_snapshot
    from hf_speedup.tiny import causal_lm_collator

    config = preset_config(a.one)
    tok = load_tokenizer(a.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    rows = rows_for_run(tok, a.steps * a.batch_size, a.seq_len, a.seed)
    model = load_model(a.model, speedup=config)
    ends: list[float] = []
    meter = TokenMeter()

    class Timeline(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            meter.close_step()
            ends.append(time.perf_counter() - START)
            if a.timeline:  # line by line: a run killed midway (OOM, timeout) still leaves its steps
                with open(a.timeline, "a") as fh:
                    fh.write(f"{state.global_step} {ends[-1]:.3f}\n")

    kw = dict(output_dir=tempfile.mkdtemp(prefix="payback_"), per_device_train_batch_size=a.batch_size,
              max_steps=a.steps, learning_rate=2e-5, lr_scheduler_type="constant", seed=a.seed, logging_steps=1,
              save_strategy="no", report_to=[], disable_tqdm=True, dataloader_num_workers=0, use_cpu=True)
    built = time.perf_counter() - START
    trainer = counting(SpeedupTrainer, meter)(model=model, args=TrainingArguments(**kw), train_dataset=rows,
                                              data_collator=causal_lm_collator(tok), speedup=config)
    trainer.speedup_callback.print_tables = False
    trainer.add_callback(Timeline())
    trainer.train()
    report = trainer.speedup_report.to_dict()
    compile_plan = report["plan"]["compile"]
    dyn = dynamo_snapshot()
    frames = {}
    try:
        from torch._dynamo import convert_frame

        frames = {f"{k[0] if isinstance(k, tuple) else k}": int(v)
                  for k, v in getattr(convert_frame, "FRAME_COMPILE_COUNTER", {}).items()}
    except Exception:  # noqa: BLE001 - internals moved: the snapshot still has the totals
        pass
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"spec": a.one, "ends": ends, "loaded_s": built, "tokens": meter.per_step(), "rows": describe(rows),
            "threads": torch.get_num_threads(), "dtype": report["plan"]["precision"].get("applied"),
            "compile": {k: compile_plan.get(k) for k in ("requested", "applied", "engaged", "reason")},
            "report_metrics": {k: report["metrics"].get(k) for k in ("compile_seconds", "recompiles", "graph_breaks",
                                                                      "compiled_regions", "recompile_seconds")},
            "dynamo": dyn, "frame_compiles": frames, "losses": losses}


# --------------------------------------------------------------------------------------------- analysis
def durations(ends: list[float]) -> list[float]:
    """Seconds of steps 2..N (step 1 runs from the process start: it is part of the fixed cost)."""
    return [b - a for a, b in zip(ends, ends[1:])]


def steady(ends: list[float], skip: int = 3) -> float:
    """The median of steps skip+1..N."""
    return statistics.median(durations(ends)[skip - 1:])


def analyse(results: dict, lengths: list[int], steps: int, skip: int = 3) -> dict:
    """Whole runs at ``lengths``, steady steps, and (eager and compiled both present) the measured compile cost,
    saving and payback step beside pays_back's prediction. Both runs train on the same rows in the same order, so
    the saving is the median over steps skip+1..N of the paired difference (eager step i - compiled step i); the
    cost is what is left of the whole-run difference: W_compiled(N) - W_eager(N) + N x saving."""
    sys.path.insert(0, ROOT)
    from hf_speedup.features.compile.payback import MEASURED_STEPS, PAYBACK

    gain, cold, _ = PAYBACK["cpu"]
    out: dict = {"whole_run_s": {}, "steady_step_s": {}}
    for name, r in results.items():
        out["whole_run_s"][name] = {n: r["ends"][n - 1] for n in lengths if n <= len(r["ends"])}
        out["steady_step_s"][name] = steady(r["ends"], skip)
    if "eager" in results and "compiled" in results:
        e, c = results["eager"]["ends"][:steps], results["compiled"]["ends"][:steps]
        pairs = [a - b for a, b in zip(durations(e)[skip - 1:], durations(c)[skip - 1:])]
        saving = statistics.median(pairs)
        se = out["steady_step_s"]["eager"]
        cost = c[-1] - e[-1] + len(c) * saving
        out["measured"] = {"compile_cost_s": cost, "saving_per_step_s": saving, "gain": saving / se,
                           "payback_step": cost / saving if saving > 0 else None}
        predicted_saving = gain * se
        out["predicted"] = {"gain": gain, "compile_cost_s": cold, "saving_per_step_s": predicted_saving,
                            "payback_step": cold / predicted_saving,
                            # pays_back compiles when (run length - 3) x gain x eager step > cost
                            "compiles_from_run_length": MEASURED_STEPS + 1 + cold / predicted_saving}
    return out


def verdict(result: dict) -> str:
    """pays_back's verdict after step 3, as the report's compile entry gives it (in its reason)."""
    reason = result["compile"].get("reason") or ""
    marks = ("compile.when = pays_back: compiling", "compile.when = pays_back: not compiled")
    at = min((reason.find(m) for m in marks if m in reason), default=-1)
    return reason[at:] if at >= 0 else "none in the report"


def table(results: dict, analysis: dict, lengths: list[int]) -> str:
    head = "| run | " + " | ".join(f"whole run {n} steps" for n in lengths) + " | steady step | compiled | recompiles |"
    lines = [head, "|" + "---|" * (len(lengths) + 4)]
    for name, r in results.items():
        w = analysis["whole_run_s"][name]
        dyn, rep = r["dynamo"], r["report_metrics"]
        lines.append(f"| {name} | " + " | ".join(f"{w[n]:.1f} s" if n in w else "" for n in lengths)
                     + f" | {analysis['steady_step_s'][name]:.2f} s | {bool(r['compile']['engaged'])} | "
                       f"dynamo {dyn['recompiles']}, report {rep.get('recompiles')} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model folder or .gguf (benchmarks/smollm2_dir.py makes one)")
    p.add_argument("--preset", default="fast")
    p.add_argument("--precision", choices=("auto", "keep", "fp32", "bf16"), default=None,
                   help="precision.dtype edit for every run (default: the preset's own)")
    p.add_argument("--edits", default="", help="more section.field=value edits for every run, ':'-separated")
    p.add_argument("--runs", default="eager,compiled,pays_back")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--lengths", default="10,30", help="run lengths to report besides --steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--logs", default=None, help="folder for each run's log (default: a temporary one)")
    p.add_argument("--recompile-log", action="store_true", default=True, help=argparse.SUPPRESS)
    p.add_argument("--analyse", metavar="JSON[,JSON]", help="print the analysis of earlier --json files again, their "
                   "runs merged (e.g. eager and compiled run side by side as two commands)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a worker: run this spec, print JSON
    p.add_argument("--timeline", default=None, help=argparse.SUPPRESS)  # a worker: "step seconds" per step end
    a = p.parse_args(argv)
    if a.one:
        print("RESULT " + json.dumps(run_one(a), default=str), flush=True)
        return 0
    if a.analyse:
        results, lengths = {}, {int(n) for n in a.lengths.split(",") if n}
        for path in a.analyse.split(","):
            with open(path) as fh:
                saved = json.load(fh)
            results.update(saved["results"])
            lengths |= set(saved["lengths"])
        steps = min(len(r["ends"]) for r in results.values())
        lengths = sorted(n for n in lengths if n <= steps)
        summary(results, analyse(results, lengths, steps), lengths)
        return 0
    if not a.model:
        p.error("--model is required (a model folder or .gguf); fix: e.g. --model /tmp/smollm2")
    runs = [r for r in a.runs.split(",") if r]
    unknown = [r for r in runs if r not in RUNS]
    if unknown:
        p.error(f"--runs: {unknown} unknown; allowed: {', '.join(RUNS)}; fix: e.g. --runs eager,compiled")
    edits = [e for e in a.edits.split(":") if e]
    lengths = sorted({int(n) for n in a.lengths.split(",") if n} | {a.steps})
    logs = a.logs or tempfile.mkdtemp(prefix="payback_logs_")
    os.makedirs(logs, exist_ok=True)
    results = {}
    for run in runs:
        spec = spec_of(run, a.preset, a.precision, edits)
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor_cold_"),
               "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled", "PYTHONPATH": ROOT}
        cmd = [sys.executable, __file__, "--one", spec, "--model", a.model, "--steps", str(a.steps),
               "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--seed", str(a.seed)]
        log = os.path.join(logs, f"{run}.log")
        cmd += ["--timeline", os.path.join(logs, f"{run}.steps")]
        open(cmd[-1], "w").close()  # this run's steps only
        with open(log, "w") as fh:
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=fh, text=True, env=env)
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if done.returncode or not line:
            print(f"{run} ({spec}) failed (exit {done.returncode}; -9 is often the OOM killer), log: {log}, its steps "
                  f"so far: {os.path.join(logs, run + '.steps')}\n{done.stdout[-2000:]}", file=sys.stderr)
            return 1
        results[run] = r = json.loads(line[-1][7:])
        if a.json:  # after every run, so a run cut short still leaves the finished ones (--analyse reads them)
            with open(a.json, "w") as fh:
                json.dump({"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "results": results,
                           "lengths": lengths}, fh, indent=1, default=str)
        print(f"{run:9s} {spec}: {len(r['ends'])} steps, whole run {r['ends'][-1]:.1f} s, steady {steady(r['ends']):.2f} s"
              f"/step, compile {r['report_metrics']['compile_seconds']}, recompiles dynamo {r['dynamo']['recompiles']} "
              f"report {r['report_metrics']['recompiles']}, dtype {r['dtype']} (log {log})", flush=True)
    analysis = analyse(results, lengths, a.steps)
    summary(results, analysis, lengths)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "results": results,
                       "analysis": analysis, "lengths": lengths}, fh, indent=1, default=str)
    return 0


def summary(results: dict, analysis: dict, lengths: list[int]) -> None:
    print(f"\nrows: {next(iter(results.values()))['rows']}\n")
    print(table(results, analysis, lengths))
    if "measured" in analysis:
        m, pr = analysis["measured"], analysis["predicted"]
        pay = f"{m['payback_step']:.0f}" if m["payback_step"] is not None else "never (no saving)"
        print(f"\nmeasured: compile cost {m['compile_cost_s']:.1f} s, saving {m['saving_per_step_s']:.3f} s/step "
              f"({m['gain']:.1%} of an eager step): pays back after {pay} steps")
        print(f"pays_back's constants: cost {pr['compile_cost_s']:.0f} s, gain {pr['gain']:.0%} = "
              f"{pr['saving_per_step_s']:.3f} s/step: predicts payback after {pr['payback_step']:.0f} steps, so it "
              f"compiles runs of {pr['compiles_from_run_length']:.0f}+ steps")
    if "pays_back" in results:
        r = results["pays_back"]
        print(f"pays_back run: compiled {bool(r['compile']['engaged'])}; verdict: {verdict(r)}")
    for name, r in results.items():
        if r["frame_compiles"]:
            print(f"{name}: frames compiled (compiles each): {r['frame_compiles']}")


if __name__ == "__main__":
    sys.exit(main())
