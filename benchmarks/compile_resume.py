"""What a resumed run pays to compile on a machine with an empty inductor cache, with and without the compile cache
that travels with the checkpoint (``compile.cache_dir``), on SmolLM2-135M.

    python benchmarks/smollm2_dir.py /tmp/smollm2
    python benchmarks/compile_resume.py --model /tmp/smollm2 --steps 8 --save-at 4

Three processes, one after the other, each with its own empty ``TORCHINDUCTOR_CACHE_DIR`` (a fresh node): ``cold``
trains ``--steps`` steps with ``fast`` (blocks compiled from the first step: ``compile.when: always``) and saves at
``--save-at``; ``resume`` resumes a copy of that run from ``checkpoint-<save-at>`` without the cache
(``compile.cache_dir: none``, what every process paid before); ``resume+cache`` resumes another copy with it. Per
process: dynamo's compile seconds in this process, the seconds from the process start to the end of its first step,
the cache hits torch counted, and the losses after the checkpoint (which must equal the cold run's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_models import load_model, parser  # noqa: E402


def one_run(model_dir: str, out: str, steps: int, save_at: int, resume: bool, cache: bool,
            cuda: bool = False) -> dict:
    sys.path.insert(0, str(ROOT))
    import psutil
    import torch
    from transformers import TrainerCallback, TrainingArguments

    from hf_speedup import SpeedupTrainer, get_preset
    from hf_speedup.tiny import causal_lm_collator, char_tokenizer, make_rows

    first_step: list[float] = []

    class FirstStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if not first_step:
                first_step.append(time.time() - psutil.Process().create_time())

    tok = char_tokenizer()
    model = load_model(model_dir, torch.float32)
    config = get_preset("fast").replace(compile={"when": "always", "cache_dir": "auto" if cache else "none"})
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=2, learning_rate=1e-5,
                             save_strategy="steps", save_steps=save_at, logging_steps=1, report_to=[], use_cpu=not cuda,
                             disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = SpeedupTrainer(model=model, args=args, train_dataset=make_rows(tok, n=2 * steps, seed=0, pack_to=128),
                             data_collator=causal_lm_collator(tok), speedup=config, callbacks=[FirstStep()])
    trainer.speedup_callback.print_tables = False
    trainer.train(resume_from_checkpoint=os.path.join(out, f"checkpoint-{save_at}") if resume else None)
    facts = trainer.speedup_status["compile"].to_dict()["settings"]
    return {"compile_seconds": facts.get("compile_seconds_this_process"), "first_step_end_s": first_step[0],
            "cache_loaded": facts.get("cache_loaded"), "cache_hits": facts.get("cache_hits"),
            "cache_graphs_compiled": facts.get("cache_graphs_compiled"), "cache_reason": facts.get("cache_reason"),
            "cache_saved": facts.get("cache_saved"), "precision": trainer.speedup_status["precision"].applied,
            "losses": {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}}


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--save-at", type=int, default=4)
    p.add_argument("--one", nargs=3, default=None, help=argparse.SUPPRESS)  # OUT resume(0/1) cache(0/1)
    a = p.parse_args(argv)
    if a.one:
        out, resume, cache = a.one
        print("ROW " + json.dumps(one_run(a.model, out, a.steps, a.save_at, resume == "1", cache == "1", a.cuda)))
        return 0
    root = Path(tempfile.mkdtemp(prefix="compile_resume_"))
    rows = {}
    try:
        for name, resume, cache in (("cold", 0, 1), ("resume", 1, 0), ("resume+cache", 1, 1)):
            out = root / name
            if resume:
                shutil.copytree(root / "cold", out)
                shutil.rmtree(out / f"checkpoint-{a.steps}", ignore_errors=True)
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / f"inductor-{name}"), "HF_HUB_OFFLINE": "1",
                   "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
            done = subprocess.run([sys.executable, __file__, "--model", a.model, "--steps", str(a.steps), "--save-at",
                                   str(a.save_at), "--one", str(out), str(resume), str(cache)]
                                  + (["--cuda"] if a.cuda else []), env=env,
                                  capture_output=True, text=True)
            row = next((json.loads(x[4:]) for x in done.stdout.splitlines() if x.startswith("ROW ")), None)
            if row is None:
                print(done.stderr[-4000:], file=sys.stderr)
                return 1
            rows[name] = row
            print(name, json.dumps(row), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    cold = rows["cold"]
    after = {k: v for k, v in cold["losses"].items() if int(k) > a.save_at}
    print("| process | compile s (this process) | x cold | process start to first step end s | cache hits | "
          "graphs compiled | losses after the checkpoint = cold's |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        same = "-" if name == "cold" else str({k: v for k, v in r["losses"].items() if int(k) > a.save_at} == after)
        print(f"| {name} | {r['compile_seconds']:.1f} | {r['compile_seconds'] / cold['compile_seconds']:.2f} | "
              f"{r['first_step_end_s']:.1f} | {r['cache_hits']} | {r['cache_graphs_compiled']} | {same} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
