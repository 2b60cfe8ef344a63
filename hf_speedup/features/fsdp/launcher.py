"""What the launcher told this process through its environment (torchrun, ``accelerate launch``).

Read in one place so that ``decide`` stays a function of what it is given plus this one snapshot.
"""

from __future__ import annotations

import os

from ...config import FsdpSettings
from .settings import STATE_DICT_TYPES


def launched() -> bool:
    """Started by torchrun / accelerate launch (even with one process)."""
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def local_world_size(world: int) -> int:
    """Processes on this node; the whole world when the launcher does not say."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    except ValueError:
        return world


def ram_efficient_loading_set() -> bool:
    """FSDP_CPU_RAM_EFFICIENT_LOADING is on, so ``from_pretrained`` reads the weights on rank 0 only."""
    return os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "").lower() in ("1", "true")


def _env_bool(name: str) -> bool | None:
    v = os.environ.get(name)
    return None if v is None else v.strip().lower() in ("1", "true", "yes")


def launcher_fsdp() -> dict:
    """What ``accelerate launch --config_file`` asked for (its FSDP_* / PARALLELISM_CONFIG_* env), or {}."""
    out: dict = {}
    if _env_bool("ACCELERATE_USE_FSDP"):
        out["enabled"] = True
        for key, env in (("version", "FSDP_VERSION"), ("state_dict_type", "FSDP_STATE_DICT_TYPE"),
                         ("reshard_after_forward", "FSDP_RESHARD_AFTER_FORWARD"),
                         ("sharding_strategy", "FSDP_SHARDING_STRATEGY")):
            if env in os.environ:
                out[key] = os.environ[env]
        for key, env in (("cpu_offload", "FSDP_OFFLOAD_PARAMS"),
                         ("activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING")):
            if env in os.environ:
                out[key] = _env_bool(env)
    if _env_bool("ACCELERATE_USE_PARALLELISM_CONFIG"):
        for key, env in (("dp_replicate_size", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE"),
                         ("dp_shard_size", "PARALLELISM_CONFIG_DP_SHARD_SIZE")):
            try:
                out[key] = int(os.environ.get(env, "1"))
            except ValueError:
                pass
    return out


def launcher_differences(launcher: dict, requested: FsdpSettings) -> list[str]:
    """Where the launch config's FSDP settings differ from the preset's (the preset's win; the reason says so)."""
    diffs = []
    if "version" in launcher and str(launcher["version"]) != str(requested.version):
        diffs.append(f"fsdp_version={launcher['version']} (preset: {requested.version})")
    if launcher.get("cpu_offload") is not None and launcher["cpu_offload"] != requested.cpu_offload:
        diffs.append(f"fsdp_offload_params={str(launcher['cpu_offload']).lower()} "
                     f"(preset: {str(requested.cpu_offload).lower()})")
    if "state_dict_type" in launcher:
        want = STATE_DICT_TYPES[requested.state_dict_type]
        if launcher["state_dict_type"].upper() != want:
            diffs.append(f"fsdp_state_dict_type={launcher['state_dict_type']} (preset: {want})")
    return diffs
