"""Whether FSDP really engaged, judged on the live Trainer: sharded DTensors, not a DDP-wrapped whole model."""

from __future__ import annotations

from ...plan_types import Decision, Outcome
from .summary import describe, sharding_summary


def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    if not decision.active:
        return False, decision.reason
    st = decision.settings
    model = trainer.model
    summary = sharding_summary(model)
    outcome.facts["verified"] = {k: v for k, v in summary.items() if k != "this_rank"}
    wrapped = type(getattr(trainer, "model_wrapped", model)).__name__
    if "DistributedDataParallel" in wrapped:
        return False, f"NOT sharded: the Trainer wrapped the model in {wrapped}"
    if not summary["dtensor_parameters"] and summary.get("fsdp_version") != 1:
        if st.backend == "accelerate":
            if getattr(trainer, "is_fsdp_enabled", False):
                return False, "accelerate FSDP plugin active; the parameters are sharded when train() starts " \
                              "(verified again then)"
            dtype = getattr(getattr(trainer, "accelerator", None), "distributed_type", "?")
            return False, f"NOT sharded: accelerate did not enable FSDP (distributed_type={dtype})"
        return False, "NOT sharded: no parameter is a DTensor"
    text = describe(summary, st.strategy)
    if summary["plain_parameters"]:
        return False, f"{text}; but {summary['plain_parameters']} parameter(s) are not sharded (plain tensors)"
    if st.cpu_offload and st.backend == "accelerate" and summary.get("local_shard_devices") \
            and summary["local_shard_devices"] != ["cpu"]:
        text += f"; CPU offload NOT in force (shards on {', '.join(summary['local_shard_devices'])})"
        return False, text
    if st.cpu_offload and summary.get("local_shard_devices") == ["cpu"] and st.backend == "accelerate":
        text += ", shards offloaded to CPU"
    if st.strategy == "no_shard":
        return True, f"{text} (replicated on purpose: no_shard)"
    if summary["world_size"] == 1:
        return True, f"{text} (world size 1: nothing to shard across; FSDP hooks, NCCL and sharded checkpoints in use)"
    if not summary["sharded"]:
        return False, f"{text}: every rank holds the whole model"
    return True, text
