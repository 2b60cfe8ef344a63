"""FSDP checkpoints in accelerate's FSDP2 layout, so a run of either backend can resume from the other's.

``state_dict_type: sharded``: ``pytorch_model_fsdp_0/`` and ``optimizer_0/`` (torch.distributed.checkpoint,
one shard per rank). ``full``: ``pytorch_model_fsdp.bin`` and ``optimizer.bin`` (gathered, written by rank 0).
Saving and loading are collective: every rank calls them. A process that does not shard (one process, or DDP)
reads such a checkpoint whole: DCP gathers every rank's shard into its tensors (``sharded=False``).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ... import compat

MODEL_DIR = "pytorch_model_fsdp_0"  # accelerate: f"{FSDP_MODEL_NAME}_0" (DCP of {"model": state_dict})
OPTIMIZER_DIR = "optimizer_0"  # accelerate: f"{OPTIMIZER_NAME}_0" (DCP of {"optimizer": optim_state_dict})
FULL_MODEL_FILE = "pytorch_model_fsdp.bin"
FULL_OPTIMIZER_FILE = "optimizer.bin"
SCHEDULER_FILE = "scheduler.pt"  # transformers' SCHEDULER_NAME


def _dcp():
    import torch.distributed.checkpoint as dcp

    return dcp


def save_sharded_model(model: nn.Module, output_dir: str) -> str:
    """Every rank writes its own shard (torch.distributed.checkpoint); collective."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    dcp = _dcp()
    path = os.path.join(output_dir, MODEL_DIR)
    os.makedirs(path, exist_ok=True)
    dcp.save({"model": get_model_state_dict(model)}, storage_writer=dcp.FileSystemWriter(path))
    return path


def save_sharded_optimizer(model: nn.Module, optimizer, output_dir: str) -> str:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    dcp = _dcp()
    path = os.path.join(output_dir, OPTIMIZER_DIR)
    os.makedirs(path, exist_ok=True)
    osd = get_optimizer_state_dict(model, compat.unwrap_optimizer(optimizer))
    dcp.save({"optimizer": osd}, storage_writer=dcp.FileSystemWriter(path))
    return path


def full_model_state_dict(model: nn.Module) -> dict:
    """The unsharded state dict on rank 0 (CPU tensors), ``{}`` on the other ranks; collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state_dict(model: nn.Module, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, compat.unwrap_optimizer(optimizer),
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def _rank0() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def holds_fsdp_state(checkpoint: str) -> bool:
    """The checkpoint holds FSDP model state (sharded or full): what the stock Trainer loads only under FSDP."""
    return os.path.isdir(os.path.join(checkpoint, MODEL_DIR)) or os.path.isfile(
        os.path.join(checkpoint, FULL_MODEL_FILE))


def shard_count(checkpoint: str) -> int:
    """How many ranks wrote the sharded model state (one ``.distcp`` file each); 0 for a full one."""
    folder = os.path.join(checkpoint, MODEL_DIR)
    return sum(name.endswith(".distcp") for name in os.listdir(folder)) if os.path.isdir(folder) else 0


def load_model_checkpoint(model: nn.Module, checkpoint: str, sharded: bool = True) -> str:
    """Load an FSDP checkpoint (sharded DCP or full file) into ``model``; returns what was read.

    ``sharded``: ``model`` is sharded over the process group (collective: every rank calls it, DCP reshards
    to this world size). ``False``: a model that is not sharded (one process, or DDP), which gets the whole
    tensors: DCP reads every rank's shard in this process (``no_dist``), no process group involved.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    folder = os.path.join(checkpoint, MODEL_DIR)
    full = os.path.join(checkpoint, FULL_MODEL_FILE)
    if os.path.isdir(folder):
        dcp = _dcp()
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=not sharded)
        set_model_state_dict(model, state["model"])
        return folder
    if os.path.isfile(full):
        if not sharded:
            set_model_state_dict(model, torch.load(full, map_location="cpu", weights_only=True))
            return full
        sd = torch.load(full, map_location="cpu", weights_only=True) if _rank0() else {}
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        return full
    raise FileNotFoundError(
        f"{checkpoint} holds no FSDP model state ({MODEL_DIR}/ or {FULL_MODEL_FILE}); hf_speedup FSDP runs resume "
        "only from checkpoints they wrote (fsdp.state_dict_type: sharded or full)"
    )


def load_optimizer_checkpoint(model: nn.Module, optimizer, checkpoint: str, sharded: bool = True) -> str | None:
    """The optimizer's part of :func:`load_model_checkpoint` (same ``sharded``); None when the checkpoint has none."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    opt = compat.unwrap_optimizer(optimizer)
    folder = os.path.join(checkpoint, OPTIMIZER_DIR)
    full = os.path.join(checkpoint, FULL_OPTIMIZER_FILE)
    if os.path.isdir(folder):
        dcp = _dcp()
        state = {"optimizer": get_optimizer_state_dict(model, opt)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), no_dist=not sharded)
        set_optimizer_state_dict(model, opt, state["optimizer"])
        return folder
    if os.path.isfile(full):
        if not sharded:
            set_optimizer_state_dict(model, opt, torch.load(full, map_location="cpu", weights_only=True))
            return full
        osd = torch.load(full, map_location="cpu", weights_only=True) if _rank0() else {}
        set_optimizer_state_dict(model, opt, osd,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        return full
    return None
