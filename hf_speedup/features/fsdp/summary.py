"""What the parameters of a model really are: DTensors? placed how? how many bytes does each rank hold?

Read off the live model, for either backend (hf_speedup's own ``fully_shard`` on CPU, accelerate's FSDP1 or
FSDP2 on GPUs), without a collective.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ... import compat
from .shard import UNITS_ATTR


def _chunks(size: int, n: int) -> list[int]:
    """Sizes of ``torch.chunk(size, n)`` padded with zeros to ``n`` (how DTensor Shard splits a dim)."""
    if n <= 1:
        return [size]
    step = -(-size // n) if size else 0
    out = [max(0, min(step, size - i * step)) for i in range(n)]
    return out


def _per_rank_numel(p) -> dict[int, int]:
    """Elements of DTensor ``p`` held by every global rank of its mesh (computed locally, no collective)."""
    from torch.distributed.tensor import Shard

    mesh = p.device_mesh
    ranks = mesh.mesh  # tensor of global ranks, shape = mesh shape
    out: dict[int, int] = {}
    for coord in torch.cartesian_prod(*[torch.arange(s) for s in ranks.shape]).reshape(-1, ranks.dim()).tolist():
        shape = list(p.shape)
        for mesh_dim, placement in enumerate(p.placements):
            if isinstance(placement, Shard):
                shape[placement.dim] = _chunks(shape[placement.dim], ranks.shape[mesh_dim])[coord[mesh_dim]]
        numel = 1
        for s in shape:
            numel *= s
        out[int(ranks[tuple(coord)])] = numel
    return out


def fsdp2_units(model: nn.Module) -> int:
    """Number of FSDP2 units (``fully_shard`` calls): modules sharded together count once."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return 0
    fully_shard = compat.fully_shard_fn()
    seen = set()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            try:
                seen.add(id(fully_shard.state(m)))
            except Exception:  # private-ish API moved: count modules instead
                seen.add(id(m))
    return len(seen)


def _fsdp1_summary(model: nn.Module) -> dict | None:
    """FSDP1 (FlatParameter) units and this rank's bytes; None when the model has no FSDP1 wrapper."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:
        return None
    mods = FSDP.fsdp_modules(model)
    if not mods:
        return None
    local = total = 0
    strategies = sorted({getattr(getattr(m, "sharding_strategy", None), "name", "?") for m in mods})
    offload = any(getattr(getattr(m, "cpu_offload", None), "offload_params", False) for m in mods)
    for m in mods:
        handle = getattr(m, "_handle", None)
        fp = getattr(handle, "flat_param", None)
        if fp is None:
            continue
        local += fp.numel() * fp.element_size()
        total += int(getattr(fp, "_unpadded_unsharded_size", fp.shape).numel()) * fp.element_size()
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    return {"fsdp_version": 1, "units": len(mods), "world_size": world, "total_bytes": total,
            "sharding_strategies": strategies, "offload_params": offload,
            "this_rank_bytes": local, "rank_bytes": {dist.get_rank() if dist.is_initialized() else 0: local}}


def sharding_summary(model: nn.Module) -> dict:
    """What the parameters really are: DTensors? placed how? how many bytes does each rank hold?

    ``rank_bytes`` maps every global rank to the parameter bytes it holds, computed from each DTensor's
    global shape, mesh and placements (no collective, so it is safe to call on one rank only).
    """
    import torch.distributed as dist

    DTensor = compat.dtensor_cls()
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    v1 = _fsdp1_summary(model)
    if v1 is not None:
        return {**v1, "sharded": v1["world_size"] > 1 and v1["this_rank_bytes"] < v1["total_bytes"],
                "dtensor_parameters": 0, "plain_parameters": 0, "placements": ["FlatParameter"]}
    dt = plain = 0
    total = 0
    rank_bytes: dict[int, int] = {}
    plain_bytes = 0
    placements: set[str] = set()
    devices: set[str] = set()
    mesh = None
    this_rank = 0
    for p in model.parameters():
        nbytes = p.element_size()
        if DTensor is not None and isinstance(p, DTensor):
            dt += 1
            total += p.numel() * nbytes
            local = p.to_local()
            this_rank += local.numel() * nbytes
            devices.add(local.device.type)
            placements.add(str(tuple(p.placements)))
            mesh = p.device_mesh
            for r, n in _per_rank_numel(p).items():
                rank_bytes[r] = rank_bytes.get(r, 0) + n * nbytes
        else:
            plain += 1
            total += p.numel() * nbytes
            plain_bytes += p.numel() * nbytes
            this_rank += p.numel() * nbytes
    ranks = sorted(set(rank_bytes) | {rank}) if dt else [rank]
    rank_bytes = {r: rank_bytes.get(r, 0) + plain_bytes for r in ranks}
    units = fsdp2_units(model)
    sharded = bool(dt) and plain == 0 and world > 1 and max(rank_bytes.values()) < total
    return {
        "fsdp_version": 2 if dt else None,
        "units": units,
        "unit_names": list(getattr(model, UNITS_ATTR, []) or []),
        "world_size": world,
        "mesh_shape": list(mesh.mesh.shape) if mesh is not None else None,
        **_mesh_layout(mesh, world),
        "placements": sorted(placements),
        "local_shard_devices": sorted(devices),
        "dtensor_parameters": dt,
        "plain_parameters": plain,
        "total_bytes": total,
        "this_rank": rank,
        "this_rank_bytes": this_rank,
        "rank_bytes": rank_bytes,
        "sharded": sharded,
    }


def _mesh_layout(mesh, world: int) -> dict:
    """The mesh's dimension names, its shard groups (the ranks along the last dimension, which gather and
    reduce-scatter together) and where they sit: the launcher starts ``LOCAL_WORLD_SIZE`` processes per node
    and numbers the ranks node by node (torchrun, and accelerate launch through it), so rank r runs on node
    r // LOCAL_WORLD_SIZE."""
    if mesh is None:
        return {}
    ranks = mesh.mesh
    groups = ranks.reshape(-1, ranks.shape[-1]).tolist()
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    except ValueError:
        local = world
    nodes = max(1, -(-world // local))
    return {"mesh_dim_names": list(mesh.mesh_dim_names or ()), "shard_groups": groups, "nodes": nodes,
            "processes_per_node": local,
            "shard_groups_within_a_node": all(len({r // local for r in g}) == 1 for g in groups)}


def describe_layout(summary: dict) -> str:
    """E.g. ``mesh dp_replicate=2 x dp_shard=2: 2 nodes x 2 processes, shard groups [0, 1] [2, 3] each within one
    node, replicated across nodes``; empty without a mesh."""
    shape, names, groups = summary.get("mesh_shape"), summary.get("mesh_dim_names"), summary.get("shard_groups")
    if not shape or not names or groups is None:
        return ""
    nodes, local = summary["nodes"], summary["processes_per_node"]
    dims = " x ".join(f"{n}={s}" for n, s in zip(names, shape))
    shown = " ".join(str(g) for g in groups[:4]) + (f" ... ({len(groups)} groups)" if len(groups) > 4 else "")
    where = "each within one node" if summary["shard_groups_within_a_node"] else "spanning nodes"
    text = f"mesh {dims}: {nodes} node(s) x {local} process(es), shard group(s) {shown} {where}"
    if len(shape) > 1 and shape[0] > 1:
        text += ", replicated across " + ("nodes" if summary["shard_groups_within_a_node"] else "groups")
    return text


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def describe(summary: dict, strategy: str) -> str:
    """E.g. ``FSDP2 full_shard: 7 units, 2 ranks, 1.7 MB/rank of 3.4 MB``, then the mesh layout where known."""
    version = summary.get("fsdp_version") or 2
    per_rank = max(summary["rank_bytes"].values()) if summary.get("rank_bytes") else summary.get("this_rank_bytes", 0)
    text = (f"FSDP{version} {strategy}: {summary['units']} units, {summary['world_size']} ranks, "
            f"{fmt_bytes(per_rank)}/rank of {fmt_bytes(summary['total_bytes'])}")
    layout = describe_layout(summary)
    return f"{text}; {layout}" if layout else text
