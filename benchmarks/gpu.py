"""The GPU plan: a Llama-3.2-1B-shaped model, seq 2048, bf16, every preset against the stock peers.

    python benchmarks/gpu.py --output runs/gpu                     # all variants, ~8-10 minutes on one H100
    python benchmarks/gpu.py --variants stock,fast --steps 40        # a subset
    python benchmarks/gpu.py --dry-run --output /tmp/gpu_dry        # the same plan, tiny config, CPU, seconds

Model: ``LlamaConfig`` with Llama-3.2-1B's sizes (16 blocks, hidden 2048, MLP 8192, 32 heads, 8 KV heads,
vocab 128,256, tied embeddings), random weights, built on the device from the config: no hub. Data: the
embedded arithmetic / reversal task (character tokens) packed into full rows of ``--seq-len`` tokens, so
every token is real work and the loss falls; the same rows for every variant.

Every variant runs in its own fresh process, one after the other, with the same TrainingArguments
(``bf16=True``, batch, lr, steps). Ratios: full fine-tunes against ``stock`` (the stock Trainer in
bf16 autocast), LoRA variants against ``stock-peft`` (the stock Trainer on ``peft.get_peft_model``
with the same adapters as the ``lora`` preset). A variant that cannot run here is a row with the reason.

Per variant: median steady step time (CUDA-synchronised, after ``--warmup`` steps, which absorb the
compile), tokens/s (every token in these packed rows is a real one), MFU by the PaLM formula
(``hf_speedup.report.measure.flops_per_token``; recomputation not counted), peak CUDA memory allocated and
reserved, the time from process start to the end of step 1 (model build + compile: the cold start),
and the last logged loss.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

T_START = time.perf_counter()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

LLAMA_3_2_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
                    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
DRY_RUN = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=512,
               tie_word_embeddings=True)

# name -> (trainer: "stock" | a preset name, extra TrainingArguments, the variant its ratio is taken against)
VARIANTS: dict[str, tuple[str, dict, str]] = {
    "stock": ("stock", {}, "stock"),
    "stock-compile": ("stock", {"torch_compile": True}, "stock"),
    "liger": ("stock", {"use_liger_kernel": True}, "stock"),
    "fast": ("fast", {}, "stock"),
    "memory": ("memory", {}, "stock"),
    "stock-peft": ("stock-peft", {}, "stock-peft"),
    "lora": ("lora", {}, "stock-peft"),
    "qlora": ("qlora", {}, "stock-peft"),
}
DEFAULT_VARIANTS = "stock,stock-compile,liger,fast,memory,stock-peft,lora,qlora"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--output", default="runs/gpu", help="one folder for every result")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=8, help="steps before measuring (compile, autotune, allocator)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per variant before it is a failed row")
    p.add_argument("--dry-run", action="store_true", help="tiny config on CPU: proves the harness end to end")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------- worker
def rows(seq_len: int, n: int):
    """``n`` packed rows of exactly ``seq_len`` real tokens (no padding anywhere)."""
    from hf_speedup.tiny import arithmetic_examples, char_tokenizer

    tok = char_tokenizer()
    text = "|".join(arithmetic_examples(n * seq_len // 6 + 64, seed=0))
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) >= n * seq_len, (len(ids), n * seq_len)
    out = [{"input_ids": ids[i * seq_len:(i + 1) * seq_len], "attention_mask": [1] * seq_len} for i in range(n)]
    return tok, out


def build_model(ns, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    sizes = DRY_RUN if ns.dry_run else LLAMA_3_2_1B
    config = LlamaConfig(**sizes, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    with torch.device(device):
        return LlamaForCausalLM(config)


def quantized_model(ns, device: str, workdir: str):
    """QLoRA loads its base quantized: save the random model once, then ``hf_speedup.load_model``."""
    import torch

    from hf_speedup import load_model

    path = os.path.join(workdir, "base_model")
    if not os.path.exists(os.path.join(path, "config.json")):
        build_model(ns, device).to(torch.bfloat16).save_pretrained(path)
        torch.cuda.empty_cache() if device == "cuda" else None
    return load_model(path, speedup="qlora")


def peft_model(model):
    """The stock way to LoRA: peft with the same adapters as the ``lora`` preset (r 16, alpha 32, all projections)."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=targets,
                                            task_type="CAUSAL_LM"))


class StepTimer:
    """CUDA-synchronised wall time of each optimizer step (the same overhead for every variant)."""

    def __init__(self, device: str):
        import torch
        from transformers import TrainerCallback

        sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        timer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                sync()
                timer.t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                sync()
                now = time.perf_counter()
                timer.steps.append(now - timer.t0)
                if len(timer.steps) == 1:
                    timer.first_step_end = now - T_START

        self.steps: list[float] = []
        self.t0 = 0.0
        self.first_step_end = None
        self.callback = _Callback()


def run_worker(ns) -> dict:
    import torch
    from transformers import Trainer, TrainingArguments

    from hf_speedup import SpeedupTrainer
    from hf_speedup.model_info import parameter_counts
    from hf_speedup.report.measure import attention_dims, flops_per_token
    from hf_speedup.peak_flops import peak_flops_for
    from hf_speedup.tiny import causal_lm_collator

    name = ns.worker
    kind, extra, _ = VARIANTS[name]
    device = "cpu" if ns.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        return {"variant": name, "error": "needs a CUDA device (use --dry-run on CPU)"}
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    workdir = os.path.abspath(ns.output)
    steps = ns.warmup + ns.steps
    tok, data = rows(ns.seq_len, ns.batch_size * steps)
    if extra.get("use_liger_kernel") and (device != "cuda" or importlib.util.find_spec("liger_kernel") is None):
        return {"variant": name, "error": "liger-kernel runs on CUDA only and must be installed (pip install "
                                          "liger-kernel)" + ("; this run is on CPU" if device != "cuda" else "")}
    if kind == "qlora":
        if device != "cuda":
            return {"variant": name, "error": "QLoRA's 4-bit base needs CUDA (bitsandbytes); not run on CPU"}
        model = quantized_model(ns, device, workdir)
    else:
        model = build_model(ns, device)
    if kind == "stock-peft":
        model = peft_model(model)
    lora = kind in ("stock-peft", "lora", "qlora")
    args = TrainingArguments(
        output_dir=os.path.join(workdir, name), per_device_train_batch_size=ns.batch_size, max_steps=steps,
        learning_rate=2e-4 if lora else 1e-4, warmup_steps=2, lr_scheduler_type="constant_with_warmup",
        logging_steps=max(1, steps // 8), save_strategy="no", report_to=[], seed=0, disable_tqdm=True,
        bf16=device == "cuda", use_cpu=device == "cpu", dataloader_num_workers=0, **extra)
    timer = StepTimer(device)
    common = dict(model=model, args=args, train_dataset=data, data_collator=causal_lm_collator(tok),
                  callbacks=[timer.callback])
    if kind.startswith("stock"):
        trainer = Trainer(**common)
    else:
        trainer = SpeedupTrainer(**common, speedup=kind)
    trainer.train()

    steady = timer.steps[ns.warmup:]
    median = statistics.median(steady)
    tokens_per_step = ns.batch_size * ns.seq_len
    counts = parameter_counts(trainer.model)
    layers, width = attention_dims(trainer.model)
    fpt = flops_per_token(counts.matmul_trainable, counts.matmul_frozen, layers, width, ns.seq_len)
    peak = peak_flops_for(torch.cuda.get_device_name() if device == "cuda" else None, "bf16")
    tps = tokens_per_step / median
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    row = {
        "variant": name, "trainer": kind, "step_time_s": median,
        "step_time_p10_s": sorted(steady)[len(steady) // 10], "step_time_p90_s": sorted(steady)[-1 - len(steady) // 10],
        "tokens_per_second": tps, "mfu": fpt * tps / peak if peak else None, "flops_per_token": fpt,
        "cold_start_s": timer.first_step_end, "first_step_s": timer.steps[0], "losses": losses,
        "trainable_parameters": counts.trainable, "total_parameters": counts.total,
    }
    if device == "cuda":
        row["peak_memory_allocated_bytes"] = torch.cuda.max_memory_allocated()
        row["peak_memory_reserved_bytes"] = torch.cuda.max_memory_reserved()
        row["device"] = torch.cuda.get_device_name()
    report = getattr(trainer, "speedup_report", None)
    if report is not None:
        d = report.to_dict()
        row["plan"] = {k: {"applied": v.get("applied"), "engaged": v.get("engaged"), "reason": v.get("reason")}
                       for k, v in d["plan"].items()}
        row["report_metrics"] = d["metrics"]
    return row


# ------------------------------------------------------------------------------------------- parent
def run_variant(ns, name: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--output", ns.output,
           "--batch-size", str(ns.batch_size), "--seq-len", str(ns.seq_len), "--steps", str(ns.steps),
           "--warmup", str(ns.warmup)] + (["--dry-run"] if ns.dry_run else [])
    log = os.path.join(ns.output, f"{name}.log")
    t0 = time.perf_counter()
    try:
        with open(log, "w") as fh:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, timeout=ns.timeout)
    except subprocess.TimeoutExpired:
        return {"variant": name, "error": f"timed out after {ns.timeout} s (see {log})"}
    result = os.path.join(ns.output, f"{name}.json")
    if proc.returncode != 0 or not os.path.exists(result):
        with open(log) as fh:
            tail = fh.read().strip().splitlines()[-3:]
        return {"variant": name, "error": f"exit {proc.returncode} after {time.perf_counter() - t0:.0f} s: "
                                          + " | ".join(tail)}
    with open(result) as fh:
        return json.load(fh)


def table(results: list[dict]) -> str:
    by_name = {r["variant"]: r for r in results}
    lines = ["| variant | tokens/s | x ref (ref) | step ms | MFU | peak alloc GiB | cold start s | last loss |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | not run: {r['error']} |||||||")
            continue
        ref_name = VARIANTS[r["variant"]][2]
        ref = by_name.get(ref_name, {})
        ratio = (f"{r['tokens_per_second'] / ref['tokens_per_second']:.2f} ({ref_name})"
                 if ref.get("tokens_per_second") else f"- ({ref_name} not run)")
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        mem = r.get("peak_memory_allocated_bytes")
        mem = f"{mem / 2**30:.1f}" if mem else "-"
        loss = f"{r['losses'][-1]:.3f}" if r.get("losses") else "-"
        lines.append(f"| {r['variant']} | {r['tokens_per_second']:,.0f} | {ratio} | {1000 * r['step_time_s']:.1f} | "
                     f"{mfu} | {mem} | {r['cold_start_s']:.1f} | {loss} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ns = parse_args(argv)
    os.makedirs(ns.output, exist_ok=True)
    if ns.worker:
        row = run_worker(ns)
        with open(os.path.join(ns.output, f"{ns.worker}.json"), "w") as fh:
            json.dump(row, fh, indent=1, default=str)
        return [row]
    names = [v.strip() for v in ns.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: {unknown} not allowed; allowed: {', '.join(VARIANTS)}")
    if ns.dry_run:
        ns.batch_size, ns.seq_len, ns.steps, ns.warmup = min(ns.batch_size, 2), min(ns.seq_len, 128), 3, 1
    results = []
    for name in names:
        results.append(run_variant(ns, name))
        print(f"{name}: " + ("ERROR " + results[-1]["error"] if "error" in results[-1]
                             else f"{results[-1]['tokens_per_second']:,.0f} tokens/s"), flush=True)
    with open(os.path.join(ns.output, "results.json"), "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    md = table(results)
    with open(os.path.join(ns.output, "table.md"), "w") as fh:
        fh.write(md + "\n")
    print(md)
    return results


if __name__ == "__main__":
    main()
