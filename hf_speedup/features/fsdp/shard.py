"""FSDP2 ``fully_shard`` done by hf_speedup itself, for CPU processes (gloo).

accelerate enables FSDP only on accelerators: on CPU the stock Trainer would train with DDP, every rank
holding the whole model, so hf_speedup shards the model here (``trainer_hooks`` calls it).

Layout of the units (torchtitan / accelerate 1.15 style): one FSDP unit per decoder block (the block
finder shared with compile and checkpointing), the input embeddings alone, the final norm together with
the output head (``reshard_after_forward=False``: it is the first thing backward needs), and the root.
Tied input/output embeddings stay in the root unit so the shared weight belongs to exactly one unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ... import compat
from ...blocks import find_blocks, find_final_norm, unwrap_model
from .settings import Settings

UNITS_ATTR = "_hf_speedup_fsdp_units"  # the unit names, kept on the sharded model for the summary


@dataclass(frozen=True)
class ShardSpec:
    """What :func:`shard_model` does; built from the fsdp Decision's settings."""

    strategy: str = "full_shard"
    reshard_after_forward: bool = True
    mesh_shape: tuple[int, ...] = (1,)
    mesh_dim_names: tuple[str, ...] = ("dp_shard",)
    cpu_offload: bool = False
    param_dtype: torch.dtype | None = None  # mixed precision: dtype of the all-gathered parameters (compute)
    reduce_dtype: torch.dtype | None = None  # dtype of the gradient reduce-scatter
    broadcast_from_rank0: bool = True  # every rank starts from rank 0's weights

    @classmethod
    def from_settings(cls, st: Settings) -> ShardSpec:
        mp = st.mixed_precision
        return cls(
            strategy=st.strategy,
            reshard_after_forward=st.reshard_after_forward,
            mesh_shape=tuple(st.mesh.shape),
            mesh_dim_names=tuple(st.mesh.dim_names),
            cpu_offload=st.cpu_offload,
            param_dtype=mp.param_dtype if mp is not None else None,
            reduce_dtype=mp.reduce_dtype if mp is not None else None,
            broadcast_from_rank0=st.cpu_ram_efficient_loading,
        )


def _embeddings(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    base = unwrap_model(model)
    emb = out = None
    try:
        emb = base.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        pass
    try:
        out = base.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        pass
    return emb, out


def _name_of(model: nn.Module, module: nn.Module) -> str:
    for name, m in model.named_modules():
        if m is module:
            return name or "<root>"
    return type(module).__name__


def shard_model(model: nn.Module, spec: ShardSpec, device_type: str = "cpu") -> list[str]:
    """``fully_shard`` every decoder block, the embeddings, norm+head, then the root; in place.

    Needs an initialised default process group. Returns the names of the units (also kept on the model).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy

    fully_shard = compat.fully_shard_fn()
    if fully_shard is None:
        raise RuntimeError(compat.fsdp2_support()[1])
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("hf_speedup FSDP: torch.distributed is not initialised; "
                           "launch with torchrun or accelerate launch")
    world = dist.get_world_size()
    shape = tuple(int(x) for x in spec.mesh_shape)
    if int(torch.tensor(shape).prod()) != world:
        raise RuntimeError(f"hf_speedup FSDP: device mesh {shape} does not cover the world size {world}")
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=spec.mesh_dim_names)
    kw: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": spec.reshard_after_forward}
    if spec.param_dtype or spec.reduce_dtype:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=spec.param_dtype, reduce_dtype=spec.reduce_dtype)
    if spec.cpu_offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type == "cuda")

    full_sd = None
    if spec.broadcast_from_rank0 and world > 1:
        full_sd = model.state_dict() if dist.get_rank() == 0 else {}

    units: list[str] = []
    for block in find_blocks(model):
        fully_shard(block, **kw)
        units.append(_name_of(model, block))
    emb, out = _embeddings(model)
    tied = emb is not None and out is not None and getattr(emb, "weight", None) is getattr(out, "weight", 0)
    if emb is not None and not tied and not isinstance(emb, FSDPModule):
        fully_shard(emb, **kw)
        units.append(_name_of(model, emb))
    if not tied:
        tail = [m for m in (find_final_norm(model), out)
                if m is not None and not isinstance(m, FSDPModule) and any(True for _ in m.parameters())]
        if tail:
            fully_shard(tail if len(tail) > 1 else tail[0], **{**kw, "reshard_after_forward": False})
            units.append("+".join(_name_of(model, m) for m in tail))
    # The root: whatever is left (tied embeddings, stray parameters); torch's default keeps it gathered.
    fully_shard(model, **{k: v for k, v in kw.items() if k != "reshard_after_forward"})
    units.append("<root>")

    if full_sd is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    setattr(model, UNITS_ATTR, units)
    return units
