"""Kill-at-random trials: does ``train(resume_from_checkpoint=True)`` recover from a SIGKILL at any moment?

Each trial is a fresh training process (the tiny Llama, ``save_steps=4``, ``save_total_limit=2``, 16 steps)
SIGKILLed from outside after a random delay (uniform up to the length of an uninterrupted run), as a scheduler does after its grace period or the OOM killer;
then a new process resumes its output folder as a requeued job does (``resume_from_checkpoint=True`` when
``get_last_checkpoint`` finds a checkpoint, else from scratch). A resume succeeds when it finishes without an
error and ends with the uninterrupted run's weights and losses, bit for bit. The runs are
tests/dist/kill_train.py's ``--sweep --random-kills``.

    python benchmarks/kill_trials.py --trials 20 --variants speedup:baseline,speedup:auto,speedup:lora,speedup:fast
    python benchmarks/kill_trials.py --trials 20 --variants stock:baseline,speedup:baseline --code /path/to/other/checkout

``--code DIR`` runs the package of another checkout (e.g. the main branch before crash-safe checkpoints).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist" / "kill_train.py"


def run_variant(trainer: str, preset: str, ns, out: Path) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / SCRIPT.name  # outside any checkout: the package comes from --code only
        shutil.copy(SCRIPT, script)
        env = {**os.environ, "PYTHONPATH": str(Path(ns.code).resolve()), "OMP_NUM_THREADS": "1",
               "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
        cmd = [sys.executable, str(script), "--sweep", "--out", str(out), "--trainer", trainer, "--presets", preset,
               "--points", "none", "--random-kills", str(ns.trials), "--min-delay", str(ns.min_delay),
               "--max-steps", "16", "--save-steps", "4", "--save-total-limit", "2", "--seed", str(ns.seed)]
        if ns.max_delay:
            cmd += ["--max-delay", str(ns.max_delay)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{trainer}:{preset} failed:\n{proc.stderr[-4000:]}")
    return json.loads((out / "sweep.json").read_text())


def summarize(rows: list[dict]) -> dict:
    killed = [r for r in rows if r["killed_by"] == "SIGKILL"]
    ok = [r for r in killed if r["error"] is None and r["same_weights"] and r["same_losses"]]
    errors = collections.Counter(r["error"].split(":")[0] for r in killed if r["error"])
    return {"trials": len(rows), "killed": len(killed),
            "left_incomplete": sum(1 for r in killed if r["incomplete_left"]),
            "resumed_ok": len(ok), "resume_errors": dict(errors),
            "finished_but_differs": sum(1 for r in killed if r["error"] is None and r not in ok)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--variants", default="speedup:baseline,speedup:auto,speedup:lora,speedup:fast",
                   help="comma-separated trainer:preset (trainer: speedup | stock)")
    p.add_argument("--code", default=str(ROOT), help="the checkout whose hf_speedup runs")
    p.add_argument("--min-delay", type=float, default=0.3)
    p.add_argument("--max-delay", type=float, default=None,
                   help="default: how long the uninterrupted run took (each kill lands within a run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="keep every run's result files here")
    p.add_argument("--json", default=None, help="write the summary as JSON")
    ns = p.parse_args(argv)
    out_root = Path(ns.out or tempfile.mkdtemp(prefix="kill_trials_"))
    summary = {}
    print(f"| variant | trials | SIGKILLed | left an incomplete checkpoint | resumed to the uninterrupted run | "
          f"resume errors |")
    print("|---|---|---|---|---|---|")
    for variant in ns.variants.split(","):
        trainer, preset = variant.split(":")
        rows = run_variant(trainer, preset, ns, out_root / variant.replace(":", "-"))
        s = summary[variant] = summarize(rows)
        errs = ", ".join(f"{k} x{v}" for k, v in s["resume_errors"].items()) or "none"
        print(f"| {variant} | {s['trials']} | {s['killed']} | {s['left_incomplete']} | "
              f"{s['resumed_ok']}/{s['killed']} | {errs} |", flush=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
