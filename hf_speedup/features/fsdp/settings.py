"""The fsdp decision's frozen settings, and their one translation into accelerate's FSDP options.

The Trainer path (``TrainingArguments.fsdp_config``) and the ``accelerate launch`` config files
(``accelerate_config.py``) both take their FSDP options from :func:`fsdp_config`, so the two cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

NAME = "fsdp"

# Settings.backend of a run the preset does not shard but an ``accelerate launch`` FSDP config does (accelerate
# builds its plugin from ACCELERATE_USE_FSDP on accelerators): hf_speedup applies nothing, the report says so
LAUNCH_CONFIG = "launch_config"

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
    # every block class (a vision-language model has a vision and a text block): all are wrapped, since naming
    # only one replaces accelerate's default (every ``_no_split_modules`` class) and leaves the others unwrapped
    block_classes: tuple[str, ...] = ()

    def class_names(self) -> list[str]:
        return list(self.block_classes) or ([self.block_class] if self.block_class else [])


@dataclass(frozen=True)
class MixedPrecision:
    param_dtype: torch.dtype  # all-gathered parameters (compute)
    reduce_dtype: torch.dtype = torch.float32  # gradient reduce-scatter


@dataclass(frozen=True)
class Settings:
    backend: str | None = None  # accelerate (GPUs, TrainingArguments) | hf_speedup (CPU, fully_shard) | LAUNCH_CONFIG
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
    if settings.wrap is not None and settings.wrap.class_names():
        cfg["transformer_layer_cls_to_wrap"] = settings.wrap.class_names()
    if settings.version == 1:
        cfg["use_orig_params"] = True  # LoRA (mixed requires_grad) and torch.compile need the original params
        cfg["sync_module_states"] = settings.cpu_ram_efficient_loading
        cfg["backward_prefetch"] = "BACKWARD_PRE"
        cfg["forward_prefetch"] = False
    return cfg


def plugin_overrides(settings: Settings) -> dict:
    """accelerate plugin kwargs that ``TrainingArguments.fsdp_config`` cannot carry; set on ``fsdp_plugin_args``.

    - ``cpu_offload``, always: transformers forwards it only when true, and accelerate then falls back to
      ``FSDP_OFFLOAD_PARAMS`` from an ``accelerate launch`` YAML, which would override the preset's ``false``.
    - FSDP1 ``sharding_strategy``: transformers sends the strategy as ``reshard_after_forward`` only, while
      accelerate fills ``sharding_strategy`` from ``FSDP_SHARDING_STRATEGY`` (default FULL_SHARD) and prefers it,
      so ``no_shard`` would run as FULL_SHARD.
    - mixed precision with float32 gradient reduction, for either version (accelerate's default reduces in
      the compute dtype).
    """
    out: dict = {"cpu_offload": settings.cpu_offload}
    if settings.version == 1:
        out["sharding_strategy"] = settings.strategy.upper()
    mp = settings.mixed_precision
    if mp is not None:
        last = {"output_dtype": mp.param_dtype} if settings.version == 2 else {"buffer_dtype": mp.param_dtype}
        out["mixed_precision_policy"] = {"param_dtype": mp.param_dtype, "reduce_dtype": mp.reduce_dtype, **last}
    return out


# fsdp_config key -> its name in an accelerate launch config file (after the fsdp_ prefix), where they differ
_LAUNCH_FILE_NAMES = {"cpu_offload": "offload_params"}


def launch_file_fsdp_config(settings: Settings) -> dict:
    """:func:`fsdp_config` in the spelling of an ``accelerate launch --config_file`` YAML's ``fsdp_config``."""
    out = {}
    cfg = fsdp_config(settings)
    if settings.version == 1:  # the launcher exports FSDP_SHARDING_STRATEGY (default FULL_SHARD), which FSDP1 prefers
        cfg = {**cfg, "sharding_strategy": settings.strategy}
    for key, value in cfg.items():
        if key in ("reshard_after_forward", "sharding_strategy") and isinstance(value, str):
            value = value.upper()  # the FSDP1 ShardingStrategy member, as accelerate's questionnaire writes it
        elif key == "transformer_layer_cls_to_wrap":
            value = ",".join(value)  # the launcher passes it on as one comma-separated string
        out["fsdp_" + _LAUNCH_FILE_NAMES.get(key, key)] = value
    return out
