"""What the launcher told this process through its environment (torchrun, ``accelerate launch``).

Read in one place so that ``decide`` stays a function of what it is given plus this one snapshot.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

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
    if _env_bool(PARALLELISM_SWITCH):
        for key, env in (("dp_replicate_size", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE"),
                         ("dp_shard_size", "PARALLELISM_CONFIG_DP_SHARD_SIZE"),
                         ("tp_size", "PARALLELISM_CONFIG_TP_SIZE"), ("cp_size", "PARALLELISM_CONFIG_CP_SIZE"),
                         ("sp_size", "PARALLELISM_CONFIG_SP_SIZE")):
            try:
                out[key] = int(os.environ.get(env, "1"))
            except ValueError:
                pass
    return out


PARALLELISM_SWITCH = "ACCELERATE_USE_PARALLELISM_CONFIG"  # set by accelerate launch for a parallelism_config


def parallelism_problem(launcher: dict, device: str, world: int, applied_here: bool) -> str | None:
    """What accelerate's ``Accelerator()`` would refuse in the launch config's ``parallelism_config``, said before
    any model work (accelerate raises inside ``Trainer.__init__``, on every rank): a layout that does not cover
    the processes, or any layout on CPU processes, where accelerate's FSDP is off (``MULTI_CPU``) — unless
    hf_speedup applies it itself (``applied_here``: its own FSDP2 on CPU builds that mesh; tensor and context
    parallel sizes it cannot)."""
    if "dp_replicate_size" not in launcher:
        return None
    sizes = {k: max(1, launcher.get(k) or 1)
             for k in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")}
    shown = ", ".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "all sizes 1"
    total = sizes["dp_replicate_size"] * sizes["dp_shard_size"] * sizes["tp_size"] * sizes["cp_size"] * sizes["sp_size"]
    where = f"the accelerate launch config's parallelism_config ({shown})"
    if total != world and not (applied_here and sizes["tp_size"] == sizes["cp_size"] == sizes["sp_size"] == 1):
        shard = max(1, world // (total // sizes["dp_shard_size"]))
        return (f"{where} covers {total} processes but {world} run; accelerate refuses it (ParallelismConfig "
                "total_size does not match num_processes); allowed: sizes whose product is the number of processes; "
                f"fix: set parallelism_config_dp_shard_size: {shard} in the "
                "accelerate config (the product of its sizes = num_processes), or drop parallelism_config")
    if device != "cpu" or total <= 1:
        return None
    if applied_here and sizes["tp_size"] == sizes["cp_size"] == sizes["sp_size"] == 1:
        return None
    if applied_here:
        return (f"{where}: tensor and context parallelism need accelerate's FSDP2 on GPUs; on CPU processes "
                "hf_speedup applies only dp_replicate_size x dp_shard_size; allowed on CPU: tp_size and cp_size 1; "
                "fix: drop parallelism_config_tp_size / _cp_size from the accelerate config")
    return (f"{where} is refused by accelerate on CPU processes ('ParallelismConfig is only compatible "
            "DistributedType.FSDP (version 2) ... but got DistributedType.MULTI_CPU': accelerate's FSDP runs on "
            "accelerators only); allowed on CPU: an fsdp preset, whose own FSDP2 builds that mesh (fsdp.strategy: "
            "hybrid_shard), or a launch config without parallelism_config; fix: speedup='fsdp' (or a config with "
            "fsdp.enabled: true), or drop the parallelism_config section from the accelerate config")


@contextmanager
def parallelism_kept_from_accelerate():
    """While the Trainer builds its Accelerator: ``Accelerator()`` turns ACCELERATE_USE_PARALLELISM_CONFIG into a
    ParallelismConfig and refuses it on CPU processes. Where hf_speedup's own FSDP2 applies that layout, the switch
    is set aside for that call and put back after it. Yields whether it was set."""
    value = os.environ.pop(PARALLELISM_SWITCH, None)
    try:
        yield value is not None
    finally:
        if value is not None:
            os.environ[PARALLELISM_SWITCH] = value


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
