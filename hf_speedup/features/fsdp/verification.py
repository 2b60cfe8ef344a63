"""Whether FSDP really engaged, judged on the live Trainer: sharded DTensors, not a DDP-wrapped whole model."""

from __future__ import annotations

from ...plan_types import Decision, Outcome
from .settings import LAUNCH_CONFIG
from .summary import describe, sharding_summary


def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    if not decision.active:
        return False, decision.reason
    engaged, text = _verify_live(decision.settings, trainer, outcome)
    if decision.settings.backend == LAUNCH_CONFIG:  # not hf_speedup's sharding: say whose it is
        return engaged, f"accelerate's FSDP from the launch config, not the preset: {text}"
    return engaged, text


def _verify_live(st, trainer, outcome: Outcome) -> tuple[bool, str]:
    model = trainer.model
    summary = sharding_summary(model)
    outcome.facts["verified"] = {k: v for k, v in summary.items() if k != "this_rank"}
    wrapped = type(getattr(trainer, "model_wrapped", model)).__name__
    if "DistributedDataParallel" in wrapped:
        return False, f"NOT sharded: the Trainer wrapped the model in {wrapped}"
    if not summary["dtensor_parameters"] and summary.get("fsdp_version") != 1:
        if st.backend in ("accelerate", LAUNCH_CONFIG):
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
    if st.cpu_offload and st.backend == "accelerate" and summary.get("offload_params") is False:
        return False, f"{text}; CPU offload NOT in force (FSDP1 modules keep their parameters on the device)"
    if not st.cpu_offload and st.backend == "accelerate" and _offloaded(summary):
        return False, (f"{text}; CPU offload in force but NOT asked for (the preset says cpu_offload: false; e.g. "
                       "an accelerate launch YAML's fsdp_offload_params, read by accelerate as FSDP_OFFLOAD_PARAMS)")
    if st.cpu_offload and summary.get("local_shard_devices") == ["cpu"] and st.backend == "accelerate":
        text += ", shards offloaded to CPU"
    if st.strategy == "no_shard":
        return _verify_no_shard(summary, text)
    if summary["world_size"] == 1:
        return True, f"{text} (world size 1: nothing to shard across; FSDP hooks, NCCL and sharded checkpoints in use)"
    if not summary["sharded"]:
        return False, f"{text}: every rank holds the whole model"
    return True, text


def _verify_no_shard(summary: dict, text: str) -> tuple[bool, str]:
    """no_shard is engaged only when the live model is whole on every rank (and FSDP1 reports NO_SHARD): a
    launch environment's FSDP_SHARDING_STRATEGY can otherwise turn it into FULL_SHARD unnoticed."""
    live = summary.get("sharding_strategies") or []
    if summary["sharded"] or any(s != "NO_SHARD" for s in live):
        how = f"FSDP1 runs {', '.join(live)}" if live else "the parameters are split across ranks"
        return False, f"{text}: NOT no_shard — {how}"
    return True, f"{text} (replicated on purpose: no_shard)"


def _offloaded(summary: dict) -> bool:
    """Parameters offloaded to the CPU: FSDP1 says so on its modules; FSDP2 shards on an accelerator run
    live on the CPU only when offloaded."""
    if "offload_params" in summary:
        return bool(summary["offload_params"])
    return summary.get("local_shard_devices") == ["cpu"]
