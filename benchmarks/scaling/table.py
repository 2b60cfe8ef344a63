"""The scaling tables of README.md ("Several nodes"): Llama-3-8B and 70B (configs built here, on the meta device) on
nodes of 8 x H100 SXM, FSDP against HSDP, by ``hf_speedup.scaling.plan_scaling`` (what ``hf-speedup estimate
--nodes N`` prints for one row).

    python benchmarks/scaling/table.py            # markdown, as in README.md and benchmarks/RESULTS.md
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from hf_speedup.estimate import describe_for_estimate  # noqa: E402
from hf_speedup.memory_model import fmt_bytes  # noqa: E402
from hf_speedup.scaling import plan_scaling  # noqa: E402

NODES = {"llama-3-8b": (1, 2, 8, 16, 32, 64), "llama-3-70b": (1, 2, 8, 32, 64)}
MICRO_BATCH, SEQ_LEN, MEMORY = 2, 8192, 85e9  # torchtitan's Llama 3 8B runs: local batch 2 x 8192 tokens
# torchtitan docs/performance.md (Llama 3.1 8B, 1D FSDP, local batch 2, selective AC; tokens/s per GPU):
# nodes -> (FSDP, FSDP + torch.compile)
TORCHTITAN_8B = {1: (5_762, 6_667), 16: (5_605, 6_514)}
NAMES = {"full_shard": "FSDP", "hybrid_shard": "HSDP", None: "neither fits"}


def rows() -> list[str]:
    out = ["| model | nodes x 8 H100 | plan | memory/rank FSDP / HSDP | NIC bytes/GPU/step FSDP / HSDP | "
           "NIC time FSDP / HSDP | step >= (limited by) | tokens/s/GPU <= | "
           "torchtitan tokens/s/GPU (FSDP, + compile) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for model, counts in NODES.items():
        described = describe_for_estimate(str(HERE / f"{model}.json"))
        for nodes in counts:
            plan = plan_scaling(described, str(HERE / "fsdp-lean.yaml"), nodes=nodes, gpus_per_node=8,
                                batch_size=MICRO_BATCH, seq_len=SEQ_LEN, memory_bytes=MEMORY)
            best = {"full_shard": plan.fsdp, "hybrid_shard": plan.hsdp}.get(plan.chosen, plan.fsdp)
            titan = TORCHTITAN_8B.get(nodes) if model == "llama-3-8b" else None
            titan_text = (f"{titan[0]:,}, {titan[1]:,} ({plan.mfu_at(titan[0]):.0%}, {plan.mfu_at(titan[1]):.0%} "
                          "MFU)" if titan else "")
            fits = {p.strategy: "" if p.fits else " (no fit)" for p in (plan.fsdp, plan.hsdp)}
            out.append(
                f"| {model} | {nodes} ({nodes * 8} GPUs) | {NAMES[plan.chosen]} | "
                f"{fmt_bytes(plan.fsdp.memory.total_bytes)}{fits['full_shard']} / "
                f"{fmt_bytes(plan.hsdp.memory.total_bytes)}{fits['hybrid_shard']} | "
                f"{fmt_bytes(plan.fsdp.nic_bytes)} / {fmt_bytes(plan.hsdp.nic_bytes)} | "
                f"{plan.fsdp.nic_s:.3f} / {plan.hsdp.nic_s:.3f} s | "
                f"{best.bound_s:.3f} s ({best.limited_by}) | {plan.tokens_per_second_per_gpu(best):,.0f} | "
                f"{titan_text} |")
    return out


if __name__ == "__main__":
    print("\n".join(rows()))
