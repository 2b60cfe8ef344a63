"""The fsdp decision's frozen settings, and their one translation into accelerate's FSDP options.

The Trainer path (``TrainingArguments.fsdp_config``) and the ``accelerate launch`` config files
(``accelerate_config.py``) both take their FSDP options from :func:`fsdp_config`, so the two cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NAME = "fsdp"

HSDP_DIMS = ("dp_replicate", "dp_shard")  # a 2-D mesh: replicate across the first dimension, shard along the second

# fsdp.state_dict_type -> accelerate's StateDictType name
STATE_DICT_TYPES = {"sharded": "SHARDED_STATE_DICT", "full": "FULL_STATE_DICT"}


@dataclass(frozen=True)
class Mesh:
    shape: tuple[int, ...] = (1,)
    dim_names: tuple[str, ...] = ("dp_shard",)


@dataclass(frozen=True)
class Wrap:
    block_class: str | None
    blocks: int
    units: str  # what becomes an FSDP unit, in words


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype  # all-gathered parameters (compute)
    reduce_dtype: torch.dtype = torch.float32  # gradient reduce-scatter


@dataclass(frozen=True)
class Settings:
    backend: str | None = None  # accelerate (GPUs, through TrainingArguments) | hf_speedup (CPU, fully_shard)
    version: int = 2
    strategy: str = "full_shard"
    reshard_after_forward: bool = True
    mesh: Mesh = Mesh()
    wrap: Wrap | None = None
    cpu_offload: bool = False
    mixed_precision: MixedPrecision | None = None
    activation_checkpointing: bool = False  # FSDP itself checkpoints the blocks (the checkpointing feature must not)
    activation_checkpointing_by: str | None = None  # fsdp | checkpointing | None
    state_dict_type: str = "sharded"
    cpu_ram_efficient_loading: bool = True
    lora: bool = False
    parallelism: tuple[int, int] | None = None  # (dp_replicate_size, dp_shard_size) for accelerate's HSDP
    qlora_quant_storage: torch.dtype | None = None  # 4-bit weights shard only when stored in this dtype


def fsdp_config(settings: Settings) -> dict:
    """accelerate's FSDP options for ``settings``, in the key names of ``TrainingArguments.fsdp_config`` (5.x)."""
    cfg: dict = {
        "version": settings.version,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        # FSDP2 takes a bool; FSDP1 takes the ShardingStrategy name here
        "reshard_after_forward": settings.reshard_after_forward if settings.version == 2 else settings.strategy,
        "cpu_offload": settings.cpu_offload,
        "state_dict_type": STATE_DICT_TYPES[settings.state_dict_type],
        "cpu_ram_efficient_loading": settings.cpu_ram_efficient_loading,
        "activation_checkpointing": settings.activation_checkpointing,
    }
    if settings.wrap is not None and settings.wrap.block_class:
        cfg["transformer_layer_cls_to_wrap"] = [settings.wrap.block_class]
    if settings.version == 1:
        cfg["use_orig_params"] = True  # LoRA (mixed requires_grad) and torch.compile need the original params
        cfg["sync_module_states"] = settings.cpu_ram_efficient_loading
        cfg["backward_prefetch"] = "BACKWARD_PRE"
        cfg["forward_prefetch"] = False
    return cfg


# fsdp_config key -> its name in an accelerate launch config file (after the fsdp_ prefix), where they differ
_LAUNCH_FILE_NAMES = {"cpu_offload": "offload_params"}


def launch_file_fsdp_config(settings: Settings) -> dict:
    """:func:`fsdp_config` in the spelling of an ``accelerate launch --config_file`` YAML's ``fsdp_config``."""
    out = {}
    for key, value in fsdp_config(settings).items():
        if key == "reshard_after_forward" and isinstance(value, str):
            value = value.upper()  # the FSDP1 ShardingStrategy member, as accelerate's questionnaire writes it
        elif key == "transformer_layer_cls_to_wrap":
            value = ",".join(value)  # the launcher passes it on as one comma-separated string
        out["fsdp_" + _LAUNCH_FILE_NAMES.get(key, key)] = value
    return out
