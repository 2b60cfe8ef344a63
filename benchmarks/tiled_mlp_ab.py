"""The tiled MLP's cost in time, in one process: a checkpointed LoRA forward + backward through SmolLM2's blocks
with each MLP whole (as ``memory`` runs it) and tiled (as ``long`` does), the two alternated step for step so a
busy moment of this shared machine hits both alike. The loss is the hidden states' mean square (the logits and
their loss, the same in both, are left out: the ratio is the blocks', an upper bound for the whole step's).

    python benchmarks/tiled_mlp_ab.py --model /tmp/smollm2 --blocks 2 --seq-len 8192 --reps 6
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="SmolLM2-135M folder (benchmarks/smollm2_dir.py)")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--tile-tokens", type=int, nargs="+", default=[1024, 2048], help="tile lengths to compare")
    p.add_argument("--reps", type=int, default=6)
    a = p.parse_args(argv)

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_speedup.features.tiled_mlp.mechanism import TileRule, tile_mlp

    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16)
    model.model.layers = model.model.layers[:a.blocks]
    model.config.num_hidden_layers = a.blocks
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:a.blocks]
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    model.train()
    layers = model.get_base_model().model.layers
    rules = {"whole": TileRule(max_tiles=1)}
    rules.update({f"tiles of {t}": TileRule(tile_tokens=t) for t in a.tile_tokens})
    records = [tile_mlp(layer.mlp, rules["whole"]) for layer in layers]
    ids = torch.randint(0, model.config.vocab_size, (1, a.seq_len))
    base = model.get_base_model().model

    def step(rule) -> float:
        for layer in layers:
            tile_mlp(layer.mlp, rule)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = base(input_ids=ids).last_hidden_state
        h.float().pow(2).mean().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    times: dict[str, list[float]] = {k: [] for k in rules}
    for rep in range(a.reps + 1):
        for name, rule in rules.items():
            s = step(rule)
            if rep:  # the first round warms the allocator and the caches
                times[name].append(s)
        print(json.dumps({"rep": rep, **{k: round(v[-1], 3) for k, v in times.items() if v}}), flush=True)
    whole = statistics.median(times["whole"])
    print(f"\n{a.blocks} blocks, {a.seq_len} tokens, LoRA r16 all-linear, bf16, checkpointed blocks, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; tiles in the last call: "
          f"{records[0].tiles}")
    print("| MLP | median s | x whole (median) | per-rep ratios |\n|---|---|---|---|")
    for name, ts in times.items():
        ratios = [t / w for t, w in zip(ts, times["whole"])]
        print(f"| {name} | {statistics.median(ts):.2f} | {statistics.median(ts) / whole:.3f} | "
              + ", ".join(f"{r:.2f}" for r in ratios) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
