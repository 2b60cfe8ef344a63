"""Mixture-of-experts kernels: the per-expert loop vs batched_mm vs grouped_mm vs what ``experts: auto`` chooses, on
scaled-down Qwen3-MoE / OLMoE / Mixtral shapes (built from config, random weights, random tokens), then ``fast``
against the stock Trainer on one of them, and what regional compile does with the routing.

    python benchmarks/bench_moe.py                         # all three parts, modest sizes (a few minutes on 2 cores)
    python benchmarks/bench_moe.py --parts kernels --steps 8 --batch 4 --seq 256

Part ``kernels``: per architecture, each implementation trains the same model (same seed, same batches, AdamW) in
lock step (step i of every implementation back to back, so a busy moment of a shared machine falls on all alike);
steady step = median of the steps after the first; whole = the door's measurement (auto only, a fresh cache) + all
steps. Part ``trainer``: ``SpeedupTrainer(speedup="fast")`` (and ``fast-compiled``: its MoE blocks compiled by
inductor from the first step; ``fast-eager``: never compiled) vs ``transformers.Trainer`` (whole run, steady step,
losses, the report's compile counters). Part ``compile``: each decoder block under ``torch.compile`` (dynamo with
the ``eager`` backend: graphs, breaks and recompiles, no code generation) for steps whose routing differs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch  # noqa: E402

KERNELS = ("eager", "batched_mm", "grouped_mm")


def _fast(**changes):
    def config():
        from hf_speedup import get_preset

        return get_preset("fast").replace(**changes) if changes else "fast"

    return config


VARIANTS = {  # part trainer's SpeedupTrainer variants (``stock`` is transformers.Trainer)
    "fast": _fast(),
    "fast-compiled": _fast(compile={"when": "always"}),  # the MoE blocks compiled (inductor) from the first step
    "fast-eager": _fast(compile={"enabled": False}),
}


def config(arch: str, hidden: int, layers: int = 2):
    import transformers as T

    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=512, max_position_embeddings=1024, attention_dropout=0.0, pad_token_id=0)
    if arch == "qwen3_moe":  # Qwen3-30B-A3B: 128 experts top-8, expert width 768 = 0.375 h
        return T.Qwen3MoeConfig(**common, head_dim=hidden // 4, num_experts=16, num_experts_per_tok=4,
                                moe_intermediate_size=hidden, intermediate_size=2 * hidden)
    if arch == "olmoe":  # OLMoE-1B-7B: 64 experts top-8, expert width 1024 = 0.5 h
        return T.OlmoeConfig(**common, num_experts=32, num_experts_per_tok=8, intermediate_size=hidden // 2)
    return T.MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2, intermediate_size=hidden * 7 // 2)


LAYERS = 2  # set from --layers


def build(arch: str, hidden: int):
    import transformers as T

    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(config(arch, hidden, LAYERS))


def batches(n: int, batch: int, seq: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 512, (batch, seq), generator=g) for _ in range(n)]


def part_kernels(a) -> list[dict]:
    from hf_speedup import measured, plan_for

    rows = []
    for arch in a.archs.split(","):
        data = batches(a.steps, a.batch, a.seq)
        os.environ[measured.MEASURE_ENV] = "1"
        os.environ[measured.CACHE_ENV] = a.cache or tempfile.mkdtemp(prefix="bench_moe_cache_")
        probe = build(arch, a.hidden)
        start = time.perf_counter()
        from hf_speedup import get_preset

        decision = plan_for(get_preset("auto").replace(precision={"dtype": a.dtype}), model=probe)["experts"]
        door = time.perf_counter() - start
        from hf_speedup.features.experts.timing import shapes
        from hf_speedup.model_info import describe_model

        s = {**shapes(describe_model(probe)), "tokens": a.batch * a.seq}
        gathered = s["tokens"] * s["top_k"] * 3 * s["width"] * s["hidden"] * 4
        kernels = [k for k in KERNELS if k != "batched_mm" or gathered <= a.gather_limit]
        if len(kernels) < len(KERNELS):
            rows.append({"arch": arch, "kernel": "batched_mm", "steady_s": "skipped",
                         "losses": f"would gather {gathered / 2**30:.1f} GiB of expert weights per layer"})
        runs = {k: build(arch, a.hidden) for k in kernels}
        opts = {}
        for k, m in runs.items():
            m.set_experts_implementation(k)
            m.train()
            opts[k] = torch.optim.AdamW(m.parameters(), lr=1e-3)
        times = {k: [] for k in kernels}
        losses = {k: [] for k in kernels}
        for x in data:  # lock step
            for k in kernels:
                t = time.perf_counter()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
                    loss = runs[k](x, labels=x).loss
                loss.backward()
                opts[k].step()
                opts[k].zero_grad(set_to_none=True)
                times[k].append(time.perf_counter() - t)
                losses[k].append(round(loss.item(), 5))
        for k in kernels:
            steady = statistics.median(times[k][1:])
            rows.append({"arch": arch, "kernel": k + (" (auto)" if k == decision.applied else ""),
                         "steady_s": steady, "whole_s": sum(times[k]) + (door if k == decision.applied else 0),
                         "x_loop": statistics.median(times["eager"][1:]) / steady, "losses": losses[k]})
        rows.append({"arch": arch, "kernel": f"auto -> {decision.applied}", "door_s": door,
                     "reason": decision.reason})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def part_trainer(a) -> list[dict]:
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments, default_data_collator

    from hf_speedup import SpeedupTrainer

    os.environ["HF_SPEEDUP_MEASURE"] = "1"
    data = batches(a.trainer_steps, a.batch, a.seq)
    rows_ = [{"input_ids": r.tolist(), "labels": r.tolist(), "attention_mask": [1] * a.seq} for x in data for r in x]
    out = []
    for variant in a.trainer_variants.split(","):
        model = build(a.trainer_arch, a.hidden)
        args = TrainingArguments(output_dir=tempfile.mkdtemp(prefix=f"bench_moe_{variant}_"), use_cpu=True,
                                 per_device_train_batch_size=a.batch, max_steps=a.trainer_steps, logging_steps=1,
                                 report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
                                 dataloader_num_workers=0, train_sampling_strategy="sequential")
        kw = dict(model=model, args=args, train_dataset=Dataset.from_list(rows_), data_collator=default_data_collator)
        start = time.perf_counter()
        trainer = Trainer(**kw) if variant == "stock" else SpeedupTrainer(**kw, speedup=VARIANTS[variant]())
        stamps = []
        from transformers import TrainerCallback

        class Clock(TrainerCallback):
            def on_step_end(self, *_, **__):
                stamps.append(time.perf_counter())

        trainer.add_callback(Clock())
        trainer.train()
        whole = time.perf_counter() - start
        steps = [b - a_ for a_, b in zip(stamps, stamps[1:])]
        row = {"variant": variant, "whole_s": whole, "steady_s": statistics.median(steps[len(steps) // 2:]),
               "losses": [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h],
               "experts": model.config._experts_implementation}
        if variant != "stock":
            rep = trainer.speedup_report.to_dict()
            row["plan"] = {k: (v["applied"], v["engaged"]) for k, v in rep["plan"].items()
                           if k in ("experts", "compile", "attention", "data", "optimizer")}
            row["compile"] = {k: rep["metrics"].get(k) for k in ("compile_seconds", "recompiles", "graph_breaks",
                                                                 "compiled_regions")}
            row["experts_reason"] = rep["plan"]["experts"]["reason"]
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def part_compile(a) -> list[dict]:
    from torch._dynamo.utils import counters

    from hf_speedup.blocks import find_blocks

    out = []
    for kernel in KERNELS:
        torch._dynamo.reset()
        counters.clear()
        model = build(a.trainer_arch, a.hidden)
        model.set_experts_implementation(kernel)
        for b in find_blocks(model):
            b.compile(backend="eager")
        for x in batches(4, a.batch, a.seq // 2):  # four batches, four routings
            model(x, labels=x).loss.backward()
        breaks = sum(counters["graph_break"].values())
        out.append({"kernel": kernel, "unique_graphs": counters["stats"]["unique_graphs"], "graph_breaks": breaks,
                    "recompiles": sum(v for k, v in counters["recompiles"].items()) if counters["recompiles"] else 0,
                    "break_reasons": sorted({r.splitlines()[0] for r in counters["graph_break"]})})
        print(json.dumps(out[-1]), flush=True)
    return out


def table(rows, keys) -> str:
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k, "")
            cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="kernels,trainer,compile")
    p.add_argument("--archs", default="qwen3_moe,olmoe,mixtral")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2, help="decoder blocks (every one a mixture of experts)")
    p.add_argument("--cache", default=None, help="measurement cache folder to reuse (default: a fresh one per "
                   "architecture, so the door's timing is paid and counted in auto's whole run)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="part kernels: train (and let auto time the experts) in fp32 or under bf16 autocast")
    p.add_argument("--trainer-arch", default="qwen3_moe")
    p.add_argument("--trainer-steps", type=int, default=12)
    p.add_argument("--trainer-variants", default="stock,fast", help=f"stock and any of {', '.join(VARIANTS)}")
    p.add_argument("--gather-limit", type=float, default=2 * 2**30,
                   help="skip batched_mm where it would gather more expert weights than this per layer (bytes)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    global LAYERS
    LAYERS = a.layers
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    result = {}
    parts = a.parts.split(",")
    if "kernels" in parts:
        result["kernels"] = part_kernels(a)
        print(table([r for r in result["kernels"] if "steady_s" in r],
                    ["arch", "kernel", "steady_s", "x_loop", "whole_s", "losses"]))
    if "trainer" in parts:
        result["trainer"] = part_trainer(a)
        print(table(result["trainer"], ["variant", "steady_s", "whole_s", "experts", "losses"]))
    if "compile" in parts:
        result["compile"] = part_compile(a)
        print(table(result["compile"], ["kernel", "unique_graphs", "graph_breaks", "recompiles", "break_reasons"]))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
