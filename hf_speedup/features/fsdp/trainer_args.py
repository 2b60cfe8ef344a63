"""TrainingArguments that turn on the Trainer's own (accelerate's) FSDP, for the accelerate backend."""

from __future__ import annotations

from ... import compat
from ...plan_types import Decision
from .settings import fsdp_config


def training_args(decision: Decision, args) -> dict:
    st = decision.settings
    if not decision.active or st.backend != "accelerate":
        return {}  # the hf_speedup backend shards in SpeedupTrainer; TrainingArguments cannot express it
    out = compat.fsdp_training_args(fsdp_config(st), st.strategy, st.cpu_offload,
                                    type(args) if args is not None else None)
    if st.parallelism:
        from accelerate import ParallelismConfig

        out["parallelism_config"] = ParallelismConfig(dp_replicate_size=st.parallelism[0],
                                                      dp_shard_size=st.parallelism[1])
    return out
