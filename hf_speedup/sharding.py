"""FSDP2 done by hf_speedup itself: shard the model, prove it is sharded, checkpoint it.

Why this exists: accelerate enables FSDP only on accelerators. On CPU,
``Trainer(args=TrainingArguments(use_cpu=True, fsdp=..., fsdp_config=...))`` under ``torchrun`` silently
trains with ``DistributedDataParallel`` — every rank holds the whole model. PyTorch's own FSDP2
``fully_shard`` does shard on CPU over gloo, so on CPU hf_speedup shards the model itself and keeps
the Trainer from wrapping it again (see :class:`FsdpTrainerMixin`). On CUDA the Trainer/accelerate FSDP
path is used (``features/fsdp.py`` passes ``fsdp``/``fsdp_config`` through TrainingArguments); the
verification and the summary below serve both.

Layout of the units (torchtitan / accelerate 1.15 style): one FSDP unit per decoder block (the block
finder shared with compile and checkpointing), the input embeddings alone, the final norm together with
the output head (``reshard_after_forward=False``: it is the first thing backward needs), and the root.
Tied input/output embeddings stay in the root unit so the shared weight belongs to exactly one unit.

Checkpoints use accelerate's FSDP2 layout, so either path can read the other's:
``pytorch_model_fsdp_0/`` and ``optimizer_0/`` (torch.distributed.checkpoint, one shard per rank) for
``state_dict_type: sharded``; ``pytorch_model_fsdp.bin`` and ``optimizer.bin`` (full, written by rank 0)
for ``full``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import compat
from .blocks import find_blocks

logger = logging.getLogger("hf_speedup")

MODEL_DIR = "pytorch_model_fsdp_0"  # accelerate: f"{FSDP_MODEL_NAME}_0" (DCP of {"model": state_dict})
OPTIMIZER_DIR = "optimizer_0"  # accelerate: f"{OPTIMIZER_NAME}_0" (DCP of {"optimizer": optim_state_dict})
FULL_MODEL_FILE = "pytorch_model_fsdp.bin"
FULL_OPTIMIZER_FILE = "optimizer.bin"
SCHEDULER_FILE = "scheduler.pt"  # transformers' SCHEDULER_NAME
UNITS_ATTR = "_hf_speedup_fsdp_units"

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ------------------------------------------------------------------------------------------ sharding
@dataclass(frozen=True)
class ShardSpec:
    """What :func:`shard_model` does; built from the fsdp Decision's settings."""

    strategy: str = "full_shard"
    reshard_after_forward: bool = True
    mesh_shape: tuple[int, ...] = (1,)
    mesh_dim_names: tuple[str, ...] = ("dp_shard",)
    cpu_offload: bool = False
    param_dtype: str | None = None  # mixed precision: dtype of the all-gathered parameters (compute)
    reduce_dtype: str | None = None  # dtype of the gradient reduce-scatter
    broadcast_from_rank0: bool = True  # every rank starts from rank 0's weights

    @classmethod
    def from_settings(cls, st: dict) -> "ShardSpec":
        mesh = st.get("mesh") or {}
        mp = st.get("mixed_precision") or {}
        return cls(
            strategy=st.get("strategy", "full_shard"),
            reshard_after_forward=bool(st.get("reshard_after_forward", True)),
            mesh_shape=tuple(mesh.get("shape") or (1,)),
            mesh_dim_names=tuple(mesh.get("dim_names") or ("dp_shard",)),
            cpu_offload=bool(st.get("cpu_offload", False)),
            param_dtype=mp.get("param_dtype"),
            reduce_dtype=mp.get("reduce_dtype"),
            broadcast_from_rank0=bool(st.get("cpu_ram_efficient_loading", True)),
        )


def _final_norm(base: nn.Module) -> nn.Module | None:
    """The last norm among the direct children of the base model (``model.norm``, ``transformer.ln_f``)."""
    prefix = getattr(base, "base_model_prefix", "")
    inner = getattr(base, prefix, None) if prefix else None
    inner = inner if isinstance(inner, nn.Module) else base
    found = None
    for _, child in inner.named_children():
        if "norm" in type(child).__name__.lower():
            found = child
    return found


def _embeddings(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
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
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=_DTYPES.get(spec.param_dtype),
                                               reduce_dtype=_DTYPES.get(spec.reduce_dtype))
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
        tail = [m for m in (_final_norm(model.get_base_model() if hasattr(model, "get_base_model") else model), out)
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


# ------------------------------------------------------------------------------------------ verification
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
    mesh_shape = None
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
            mesh_shape = list(p.device_mesh.mesh.shape)
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
        "mesh_shape": mesh_shape,
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


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"  # pragma: no cover


def describe(summary: dict, strategy: str) -> str:
    """E.g. ``FSDP2 full_shard: 7 units, 2 ranks, 1.7 MB/rank of 3.4 MB``."""
    version = summary.get("fsdp_version") or 2
    per_rank = max(summary["rank_bytes"].values()) if summary.get("rank_bytes") else summary.get("this_rank_bytes", 0)
    return (f"FSDP{version} {strategy}: {summary['units']} units, {summary['world_size']} ranks, "
            f"{fmt_bytes(per_rank)}/rank of {fmt_bytes(summary['total_bytes'])}")


# ------------------------------------------------------------------------------------------ checkpoints
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


def load_model_checkpoint(model: nn.Module, checkpoint: str) -> str:
    """Load an FSDP checkpoint (sharded DCP or full file) into the sharded ``model``; returns what was read."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    sharded = os.path.join(checkpoint, MODEL_DIR)
    full = os.path.join(checkpoint, FULL_MODEL_FILE)
    if os.path.isdir(sharded):
        dcp = _dcp()
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(sharded))
        set_model_state_dict(model, state["model"])
        return sharded
    if os.path.isfile(full):
        sd = torch.load(full, map_location="cpu", weights_only=True) if _rank0() else {}
        set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        return full
    raise FileNotFoundError(
        f"{checkpoint} holds no FSDP model state ({MODEL_DIR}/ or {FULL_MODEL_FILE}); hf_speedup FSDP runs resume "
        "only from checkpoints they wrote (fsdp.state_dict_type: sharded or full)"
    )


def load_optimizer_checkpoint(model: nn.Module, optimizer, checkpoint: str) -> str | None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    opt = compat.unwrap_optimizer(optimizer)
    sharded = os.path.join(checkpoint, OPTIMIZER_DIR)
    full = os.path.join(checkpoint, FULL_OPTIMIZER_FILE)
    if os.path.isdir(sharded):
        dcp = _dcp()
        state = {"optimizer": get_optimizer_state_dict(model, opt)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(sharded))
        set_optimizer_state_dict(model, opt, state["optimizer"])
        return sharded
    if os.path.isfile(full):
        osd = torch.load(full, map_location="cpu", weights_only=True) if _rank0() else {}
        set_optimizer_state_dict(model, opt, osd,
                                 options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
        return full
    return None


# ------------------------------------------------------------------------------------------ Trainer glue
class FsdpTrainerMixin:
    """The Trainer methods hf_speedup's FSDP needs; each is a pass-through unless the plan says otherwise.

    ``backend == "hf_speedup"`` (CPU): shard right after the Accelerator exists (by then every feature's
    ``apply`` has run: LoRA wrapped, checkpointing and regional compile set up, so the order is
    torchtitan's: adapters -> activation checkpointing -> compile -> FSDP), let accelerate add autocast
    only (as transformers does for a model sharded at load time) and mark the model prepared so that
    neither ``.to()`` nor DDP touches it; save/load checkpoints with torch.distributed.checkpoint.

    ``backend == "accelerate"`` (CUDA): FSDP2 mixed precision reduces gradients in fp32, and a final
    ``save_model()`` under a sharded state-dict type still writes a full, loadable model.
    """

    def _speedup_fsdp(self) -> tuple[str | None, Any]:
        plan = getattr(self, "speedup_plan", None)
        decision = plan.decisions.get("fsdp") if plan is not None else None
        if decision is None or not decision.active:
            return None, decision
        return decision.settings.get("backend"), decision

    # -- setup -----------------------------------------------------------------------------------------
    def create_accelerator_and_postprocess(self) -> None:
        backend, decision = self._speedup_fsdp()
        if backend == "accelerate":
            self._speedup_fsdp_plugin_args(decision)
        super().create_accelerator_and_postprocess()
        if backend == "hf_speedup":
            self._speedup_fsdp_shard(decision)

    def _speedup_fsdp_plugin_args(self, decision) -> None:
        mp = decision.settings.get("mixed_precision")
        plugin_args = getattr(self.args, "fsdp_plugin_args", None)
        if mp and isinstance(plugin_args, dict) and plugin_args.get("fsdp_version") == 2:
            param = _DTYPES[mp["param_dtype"]]
            plugin_args.setdefault("mixed_precision_policy", {
                "param_dtype": param, "reduce_dtype": _DTYPES[mp["reduce_dtype"]], "output_dtype": param})

    def _speedup_fsdp_shard(self, decision) -> None:
        if self.model is None:
            from .config import SpeedupConfigError

            raise SpeedupConfigError([
                "fsdp.enabled = true with model_init=...: hf_speedup shards the model it is given when the Trainer "
                "is built; fix: pass model=... (hyperparameter search with model_init is not supported with FSDP)"
            ])
        units = shard_model(self.model, ShardSpec.from_settings(decision.settings), device_type=self.args.device.type)
        logger.info("hf_speedup fsdp: sharded %d units: %s", len(units), ", ".join(units))
        # autocast only: no .to(), no DDP, and no accelerate compile (its compile_regions copies the module,
        # which an FSDP2 module refuses; hf_speedup's regional compile feature compiles the blocks instead)
        dynamo = getattr(self.accelerator.state, "dynamo_plugin", None)
        backend = getattr(dynamo, "backend", None)
        if backend is not None and str(getattr(backend, "value", backend)).upper() != "NO":
            from accelerate.utils import DynamoBackend

            logger.warning("hf_speedup fsdp: accelerate's dynamo_config (%s) is not applied to a model hf_speedup "
                           "sharded itself; use the compile feature (speedup compile.enabled) instead", backend)
            dynamo.backend = DynamoBackend.NO
            try:
                self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)
            finally:
                dynamo.backend = backend
        else:
            self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)
        compat.mark_prepared_for_accelerate(self.model)

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        backend, _ = self._speedup_fsdp()
        if backend == "hf_speedup":
            DTensor = compat.dtensor_cls()
            ids = {id(p) for p in self.model.parameters()}
            stale = [p for g in compat.unwrap_optimizer(optimizer).param_groups for p in g["params"]
                     if id(p) not in ids or not isinstance(p, DTensor)]
            if stale:
                from .config import SpeedupConfigError

                raise SpeedupConfigError([
                    f"optimizers = ({type(compat.unwrap_optimizer(optimizer)).__name__}, ...) holds {len(stale)} "
                    "parameter(s) of the unsharded model: FSDP replaces every parameter by a sharded DTensor, so "
                    "that optimizer would update nothing; fix: pass optimizer_cls_and_kwargs=(cls, kwargs) (or "
                    "TrainingArguments.optim) instead of a built optimizer"
                ])
        return optimizer

    # -- saving ----------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        backend, decision = self._speedup_fsdp()
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if backend == "hf_speedup":
            sharded = decision.settings.get("state_dict_type", "sharded") == "sharded"
            if _internal_call and sharded:
                save_sharded_model(self.model, output_dir)
                self._speedup_save_extras(output_dir)
            else:
                state_dict = full_model_state_dict(self.model)
                if _internal_call and self.args.should_save:  # before _save: save_pretrained may edit the dict
                    os.makedirs(output_dir, exist_ok=True)
                    torch.save(state_dict, os.path.join(output_dir, FULL_MODEL_FILE))
                self._save(output_dir, state_dict=state_dict)
            if self.args.push_to_hub and not _internal_call:
                self.push_to_hub(commit_message="Model save", revision=getattr(self.args, "hub_revision", None))
            return
        if (backend == "accelerate" and not _internal_call and getattr(self, "is_fsdp_enabled", False)
                and "FULL_STATE_DICT" not in str(self.accelerator.state.fsdp_plugin.state_dict_type)):
            # The stock Trainer writes no weights here under SHARDED_STATE_DICT; gather them instead.
            self._save(output_dir, state_dict=self.accelerator.get_state_dict(self.model))
            if self.args.push_to_hub:
                self.push_to_hub(commit_message="Model save", revision=getattr(self.args, "hub_revision", None))
            return
        super().save_model(output_dir, _internal_call=_internal_call)

    def _speedup_save_extras(self, output_dir: str) -> None:
        """Rank 0: the config, tokenizer and TrainingArguments next to the sharded weights."""
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            config.save_pretrained(output_dir)
        if self.processing_class is not None and hasattr(self.processing_class, "save_pretrained"):
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        backend, decision = self._speedup_fsdp()
        if backend != "hf_speedup":
            return super()._save_optimizer_and_scheduler(output_dir)
        if decision.settings.get("state_dict_type", "sharded") == "sharded":
            save_sharded_optimizer(self.model, self.optimizer, output_dir)
        else:
            osd = full_optimizer_state_dict(self.model, self.optimizer)
            if self.args.should_save:
                torch.save(osd, os.path.join(output_dir, FULL_OPTIMIZER_FILE))
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_FILE))

    # -- loading ---------------------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        backend, _ = self._speedup_fsdp()
        if backend != "hf_speedup":
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        loaded = load_model_checkpoint(model if model is not None else self.model, resume_from_checkpoint)
        logger.info("hf_speedup fsdp: model state loaded from %s", loaded)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        backend, _ = self._speedup_fsdp()
        if backend != "hf_speedup" or checkpoint is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        loaded = load_optimizer_checkpoint(self.model, self.optimizer, checkpoint)
        scheduler = os.path.join(checkpoint, SCHEDULER_FILE)
        if loaded and os.path.isfile(scheduler) and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
        logger.info("hf_speedup fsdp: optimizer state %s", f"loaded from {loaded}" if loaded else "not in checkpoint")

    def _load_best_model(self) -> None:
        backend, _ = self._speedup_fsdp()
        if backend != "hf_speedup":
            return super()._load_best_model()
        load_model_checkpoint(self.model, self.state.best_model_checkpoint)
