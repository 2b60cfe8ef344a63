"""The Trainer's own save code, with its tensor files written later: what an asynchronous checkpoint defers.

The files must be exactly what the stock Trainer writes (they load wherever they did), so the Trainer's
``_save_checkpoint`` runs as it is, and only the calls that serialize tensors are caught while it runs: on the
thread that saves, ``torch.save`` and safetensors' ``save_file`` (under every name the loaded libraries import it
as: transformers' ``safe_save_file``, peft's) freeze their object into host copies (:mod:`.staging`) and queue the
real call; ``torch.distributed.checkpoint.save`` (FSDP's sharded files, every rank its shards) stages the state dict
with torch's own stager (what DCP's ``async_save`` does) and queues the save, run later on the writers' own process
group. Small files written through ``open`` (``trainer_state.json``, ``config.json``, the tokenizer) are written
as they come: they are cheap, and the staging folder keeps them invisible until the rename.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from dataclasses import dataclass
from typing import Callable

import safetensors.torch
import torch

from .staging import HostStage, tensor_bytes

REAL_SAVE_FILE = safetensors.torch.save_file
# the libraries whose modules may hold save_file under their own name (``from safetensors.torch import save_file``)
_LIBRARIES = ("safetensors", "transformers", "peft", "trl", "accelerate", "hf_speedup")


@dataclass
class Write:
    """One file the writer thread writes."""

    path: str
    run: Callable[[], None]
    nbytes: int


def _file_key(path) -> str:
    return os.path.basename(os.fspath(path))


def _save_file_aliases() -> list[tuple[object, str, Callable]]:
    """Every loaded module attribute of the libraries above that is safetensors' ``save_file`` (or what replaced it
    there), with its current value."""
    targets = {id(REAL_SAVE_FILE), id(safetensors.torch.save_file)}
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".", 1)[0] not in _LIBRARIES:
            continue
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            if id(value) in targets and callable(value):
                found.append((module, attr, value))
    return found


@contextlib.contextmanager
def deferred_writes(stage: HostStage, writes: list[Write], group=None):
    """While the block runs on this thread, tensor files are frozen into ``stage`` and queued on ``writes``;
    sharded saves (torch.distributed.checkpoint) are staged to host memory and saved later over ``group``."""
    import torch.distributed.checkpoint as dcp

    owner = threading.get_ident()
    real_dcp_save = dcp.save
    real_torch_save = torch.save  # what the writer calls: whatever torch.save is when the save starts
    aliases = _save_file_aliases()
    real_save_file = safetensors.torch.save_file

    def torch_save(obj, f, *args, **kwargs):
        if threading.get_ident() != owner or not isinstance(f, (str, os.PathLike)):
            return real_torch_save(obj, f, *args, **kwargs)
        frozen = stage.freeze(obj, _file_key(f))
        if frozen is None:  # no room for its host copy: written now
            return real_torch_save(obj, f, *args, **kwargs)
        writes.append(Write(os.fspath(f), lambda: real_torch_save(frozen, f, *args, **kwargs), tensor_bytes(frozen)))

    def save_file(tensors, filename, *args, **kwargs):
        if threading.get_ident() != owner:
            return real_save_file(tensors, filename, *args, **kwargs)
        frozen = stage.freeze(dict(tensors), _file_key(filename))
        if frozen is None:
            return real_save_file(tensors, filename, *args, **kwargs)
        writes.append(Write(os.fspath(filename), lambda: real_save_file(frozen, filename, *args, **kwargs),
                            tensor_bytes(frozen)))

    def dcp_save(state_dict, *, checkpoint_id=None, storage_writer=None, planner=None, process_group=None,
                 **kwargs):
        if threading.get_ident() != owner:
            return real_dcp_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                                 planner=planner, process_group=process_group, **kwargs)
        where = os.fspath(getattr(storage_writer, "path", None) or checkpoint_id)
        staged = stage.stage_sharded(state_dict, _file_key(where))
        if staged is None:
            return real_dcp_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer,
                                 planner=planner, process_group=process_group, **kwargs)
        # the writers' own process group: the planning collectives never meet the training's on the default one
        writes.append(Write(where, lambda: real_dcp_save(staged, checkpoint_id=checkpoint_id,
                                                          storage_writer=storage_writer, planner=planner,
                                                          process_group=group if group is not None else process_group,
                                                          **kwargs), tensor_bytes(staged)))

    torch.save = torch_save
    dcp.save = dcp_save
    for module, attr, _ in aliases:
        setattr(module, attr, save_file)
    try:
        yield writes
    finally:
        dcp.save = real_dcp_save
        torch.save = real_torch_save
        for module, attr, value in aliases:
            setattr(module, attr, value)
        stage.settle()
