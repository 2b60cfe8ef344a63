"""The fsdp decision, one question per step: requested? which backend? which FSDP version? which strategy on
which mesh? what accelerate can express; then mixed precision, who checkpoints activations, and the reason.

:func:`settings_for_launch_file` asks the same questions for an ``accelerate launch`` config file, so the
file states what a launched run decides.
"""

from __future__ import annotations

import logging

import torch

from ... import compat
from ...config import FsdpSettings, SpeedupConfig, SpeedupConfigError
from ...dtypes import long_name
from ...plan_types import OFF, Decision, PlanContext
from .launcher import (
    launched,
    launcher_differences,
    launcher_fsdp,
    local_world_size,
    parallelism_problem,
    ram_efficient_loading_set,
)
from .settings import HSDP_DIMS, LAUNCH_CONFIG, NAME, Mesh, MixedPrecision, Settings, Wrap

logger = logging.getLogger("hf_speedup")


class _Off(Exception):
    """A step found FSDP impossible here: the decision is off, with this reason, reported as a fallback."""

    def __init__(self, why: str, detail: str = ""):
        super().__init__(why)
        self.reason = f"off: {why}{detail}"
        self.fallback = f"fsdp: {why}"


def decide(ctx: PlanContext) -> Decision:
    """The steps below, in order; a step that finds FSDP impossible here turns it off with its reason."""
    s, world = ctx.config.fsdp, ctx.caps.world_size
    user_fsdp = _user_fsdp(ctx.args)
    device = _device(ctx)
    launcher = launcher_fsdp()
    if not s.enabled:
        _refuse_launch_parallelism(launcher, device, world, applied_here=False)
        return _not_requested(user_fsdp, device, world, launcher)

    requested = {"version": s.version, "strategy": s.strategy, "cpu_offload": s.cpu_offload,
                 "state_dict_type": s.state_dict_type}
    lora_on, quant = _lora_state(ctx)
    _refuse_int8(quant)
    try:
        backend = _backend(device, world)
        version, fallbacks = _version(s.version, backend)
    except _Off as off:
        _refuse_launch_parallelism(launcher, device, world, applied_here=False)
        return _off(requested, off.reason, [off.fallback])
    strategy, launcher_groups, hsdp_fallbacks, hsdp_notes = _launcher_hsdp(s.strategy, world, launcher, backend)
    _refuse_launch_parallelism(launcher, device, world, applied_here=backend == "hf_speedup")
    mesh, mesh_fallbacks = _mesh(strategy, world, launcher_groups or _node_groups(world),
                                 launcher_hsdp=launcher_groups is not None)
    fallbacks += hsdp_fallbacks + mesh_fallbacks
    parallelism = None
    if backend == "accelerate":
        hsdp_args = strategy == "hybrid_shard" and compat.args_support_parallelism_config(
            type(ctx.args) if ctx.args is not None else None)  # asked only where it matters
        version, parallelism, limits = _accelerate_limits(version, strategy, mesh, parallelism_config=hsdp_args)
        fallbacks += limits

    mixed = _mixed_precision(ctx)
    ac, ac_why = _activation_checkpointing(ctx.config.checkpointing, backend)
    wrap, wrap_fallbacks = _wrap(ctx)
    fallbacks += wrap_fallbacks
    settings = _settings(
        s, strategy, ac, backend=backend, version=version, mesh=mesh, wrap=wrap, mixed_precision=mixed,
        lora=lora_on, parallelism=parallelism,
        # FSDP shards 4-bit weights only when they are stored in the dtype of the other parameters
        qlora_quant_storage=(mixed.param_dtype if mixed else torch.bfloat16) if quant == "4bit" else None,
    )
    notes = _notes(s, backend, user_fsdp, launcher, launcher_differences(launcher, s) + hsdp_notes)
    for fb in fallbacks:
        logger.warning("hf_speedup fsdp fallback: %s", fb)
    return Decision(NAME, requested=requested, applied=f"fsdp{version}",
                    reason=_reason(settings, world, ac_why, notes), settings=settings, fallbacks=tuple(fallbacks))


def settings_for_launch_file(config: SpeedupConfig, num_processes: int, num_machines: int) -> Settings:
    """The accelerate backend's settings on that machine layout, from the config alone.

    A launch config file is written before any run: no launcher environment, no model, and an accelerate
    with FSDP2 and ``ParallelismConfig`` (the versions the file is for) is assumed.
    """
    s = config.fsdp
    mesh, _ = _mesh(s.strategy, num_processes, (num_machines, num_processes // num_machines))
    version, parallelism, _ = _accelerate_limits(s.version, s.strategy, mesh, parallelism_config=True)
    ac, _ = _activation_checkpointing(config.checkpointing, "accelerate")
    return _settings(s, s.strategy, ac, backend="accelerate", version=version, mesh=mesh, parallelism=parallelism)


def _settings(requested: FsdpSettings, strategy: str, ac: str | None, **chosen) -> Settings:
    """What the config states passes through; the strategy fixes resharding, ``ac`` who checkpoints."""
    return Settings(strategy=strategy, reshard_after_forward=strategy != "shard_grad_op",
                    activation_checkpointing=ac == "fsdp", activation_checkpointing_by=ac,
                    cpu_offload=requested.cpu_offload, state_dict_type=requested.state_dict_type,
                    cpu_ram_efficient_loading=requested.cpu_ram_efficient_loading, **chosen)


def _off(requested, reason: str, fallbacks: list | None = None) -> Decision:
    return Decision(NAME, requested=requested, applied=OFF, reason=reason, settings=Settings(),
                    fallbacks=tuple(fallbacks or ()))


# ------------------------------------------------------------------------------------------ requested?
def _user_fsdp(args) -> str | None:
    value = getattr(args, "fsdp", None) if args is not None else None
    return str(value) if value not in (None, "", False, []) else None


def _device(ctx: PlanContext) -> str:
    """``use_cpu`` means the CPU path, whatever the machine has."""
    caps = ctx.caps
    return "cpu" if (caps.device_type == "cpu" or getattr(ctx.args, "use_cpu", False)) else caps.device_type


def _not_requested(user_fsdp: str | None, device: str, world: int, launcher: dict) -> Decision:
    """Off; but the stock Trainer's FSDP on CPU processes is a trap worth a warning (it trains with DDP), and an
    ``accelerate launch`` FSDP config shards the model on accelerators whatever the preset says (checked after
    ``TrainingArguments.fsdp``, which sets ACCELERATE_USE_FSDP itself)."""
    if user_fsdp and device == "cpu" and world > 1:
        why = (f"off: TrainingArguments.fsdp={user_fsdp!r} does NOT shard on CPU — accelerate enables FSDP only on "
               "accelerators, so the Trainer trains with plain DDP (every rank holds the whole model); fix: use "
               "speedup='fsdp' (hf_speedup shards with FSDP2 on CPU)")
        logger.warning("hf_speedup fsdp: %s", why)
        return _off(False, why, [why])
    if user_fsdp:
        return _off(False, f"not requested by hf_speedup; TrainingArguments.fsdp={user_fsdp!r} is yours "
                           "(the Trainer/accelerate shards)")
    if launcher.get("enabled"):
        return _launch_config_only(launcher, device, world)
    return _off(False, "not requested (fsdp.enabled: false)")


def _launch_config_only(launcher: dict, device: str, world: int) -> Decision:
    """The preset does not ask for FSDP but the launch config does: accelerate builds its plugin from
    ACCELERATE_USE_FSDP on accelerators (the Trainer then shards), so the decision says who shards, with the
    launch file's settings, and ``verify`` checks the live model. On CPU accelerate enables no FSDP (DDP)."""
    version = _int(launcher.get("version"), 1)  # accelerate's default when FSDP_VERSION is unset
    if device not in ("cuda", "xpu"):
        why = (f"off: the accelerate launch config enables FSDP{version}, but accelerate enables FSDP only on "
               f"accelerators, so on {device} the Trainer trains with plain DDP (every rank holds the whole model); "
               "fix: use speedup='fsdp' (hf_speedup shards with FSDP2 on CPU)")
        logger.warning("hf_speedup fsdp: %s", why)
        return _off(False, why, [why] if world > 1 else [])
    if version == 2:
        strategy = "shard_grad_op" if str(launcher.get("reshard_after_forward", "true")).lower() == "false" \
            else "full_shard"
    else:  # FSDP1: accelerate prefers FSDP_SHARDING_STRATEGY (the launcher exports FULL_SHARD by default)
        strategy = str(launcher.get("sharding_strategy", "FULL_SHARD")).lower()
    ac = bool(launcher.get("activation_checkpointing"))
    settings = Settings(backend=LAUNCH_CONFIG, version=version, strategy=strategy,
                        reshard_after_forward=strategy != "shard_grad_op",
                        cpu_offload=bool(launcher.get("cpu_offload")),
                        activation_checkpointing=ac, activation_checkpointing_by="fsdp" if ac else None)
    why = (f"not requested by the preset (fsdp.enabled: false), but the accelerate launch config enables "
           f"FSDP{version} (ACCELERATE_USE_FSDP): accelerate shards the model over {world} rank(s) with the launch "
           "file's fsdp_config, not hf_speedup's FSDP settings (verified on the live model); fix: use an FSDP "
           "preset (speedup='fsdp') or a launch config without distributed_type: FSDP")
    logger.warning("hf_speedup fsdp: %s", why)
    return Decision(NAME, requested=False, applied=f"fsdp{version} (launch config)", reason=why, settings=settings)


def _int(value, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _lora_state(ctx: PlanContext) -> tuple[bool, str | None]:
    """(LoRA adapters in the model, quantization of the base: None | "4bit" | "8bit")."""
    d = ctx.decisions.get("lora")
    model_q = ctx.model.quantization if ctx.model is not None else None
    lora_on = bool((d is not None and d.active) or (ctx.model is not None and ctx.model.is_peft))
    q = d.settings.quantization if d is not None and d.active else None
    return lora_on, q or (model_q if model_q in ("4bit", "8bit") else None)


def _refuse_launch_parallelism(launcher: dict, device: str, world: int, applied_here: bool) -> None:
    problem = parallelism_problem(launcher, device, world, applied_here)
    if problem:
        raise SpeedupConfigError([problem])


def _refuse_int8(quant: str | None) -> None:
    if quant == "8bit":
        raise SpeedupConfigError([
            "fsdp.enabled = true with an 8-bit bitsandbytes base (lora.quantization = '8bit'): FSDP cannot shard "
            "Int8 weights; allowed with FSDP: lora.quantization: null or '4bit' (QLoRA, with bnb_4bit_quant_storage "
            "= the compute dtype); fix: set lora.quantization: '4bit' or fsdp.enabled: false"
        ])


# ------------------------------------------------------------------------------------------ backend, version
def _backend(device: str, world: int) -> str:
    """accelerate shards on accelerators only; on CPU processes hf_speedup shards itself."""
    if device == "cpu":
        if world <= 1:
            raise _Off("world size 1: FSDP on one CPU process has nothing to shard across; launch several "
                       "processes, e.g. torchrun --nproc_per_node 2 train.py (note: accelerate launch --cpu starts "
                       "one process without mpirun; use accelerate launch --multi_gpu --num_processes 2 on a CPU "
                       "machine)")
        return "hf_speedup"
    if device in ("cuda", "xpu"):
        if not launched():
            raise _Off(f"one {device.upper()} process not started by a distributed launcher: the Trainer's FSDP "
                       "needs a process group; run torchrun --nproc_per_node 1 ... or accelerate launch "
                       "--num_processes 1 ... (FSDP on one GPU exercises NCCL and sharded checkpoints; it saves no "
                       "memory)")
        return "accelerate"
    raise _Off(f"FSDP is not supported on {device} (needs CUDA/XPU through accelerate, or CPU processes over gloo)")


def _version(requested: int, backend: str) -> tuple[int, list[str]]:
    """FSDP2 where this torch/accelerate has it; the hf_speedup backend has FSDP2 only."""
    ok2, why2 = compat.fsdp2_support()
    if backend == "hf_speedup":
        if not ok2:
            raise _Off(why2, " (hf_speedup shards CPU runs with FSDP2 only)" if requested == 2 else "")
        if requested == 1:
            return 2, ["fsdp.version 1 -> 2: on CPU hf_speedup shards with FSDP2 fully_shard (FSDP1 on CPU is not "
                       "wired; FSDP2 gives the same sharding)"]
        return 2, []
    if requested == 2 and not ok2:
        return 1, [f"fsdp.version 2 -> 1: {why2}"]
    return requested, []


# ------------------------------------------------------------------------------------------ strategy, mesh
def _node_groups(world: int) -> tuple[int, int]:
    """(nodes, processes per node) from the launcher; nodes = 0 when the nodes hold different numbers."""
    local = local_world_size(world)
    return (max(1, world // local) if world % local == 0 else 0), local


def _launcher_hsdp(strategy: str, world: int, launcher: dict,
                   backend: str) -> tuple[str, tuple[int, int] | None, list[str], list[str]]:
    """The HSDP layout an accelerate launch config asks for: (strategy, its (replicas, shard) groups when in force,
    fallbacks, notes)."""
    rep, shard = launcher.get("dp_replicate_size", 1), launcher.get("dp_shard_size", 0)
    if rep <= 1:
        return strategy, None, [], []
    if strategy in ("full_shard", "hybrid_shard"):
        if rep * shard != world:
            raise SpeedupConfigError([
                f"the accelerate launch config asks for HSDP with dp_replicate_size={rep} x dp_shard_size={shard}, "
                f"but {world} processes run; allowed: a product equal to num_processes; fix: set "
                f"parallelism_config_dp_shard_size: {max(1, world // rep)} in the accelerate config"
            ])
        fallbacks = [f"fsdp.strategy full_shard -> hybrid_shard: the accelerate launch config asks for HSDP "
                     f"(dp_replicate_size={rep}, dp_shard_size={shard})"] if strategy == "full_shard" else []
        return "hybrid_shard", (rep, shard), fallbacks, []
    if backend == "accelerate":
        if strategy == "no_shard":
            raise SpeedupConfigError([
                f"fsdp.strategy = 'no_shard' conflicts with the accelerate launch config's HSDP parallelism_config "
                f"(dp_replicate_size={rep}), which accelerate applies from the environment; allowed together: "
                "full_shard, shard_grad_op, hybrid_shard; fix: set fsdp.strategy: hybrid_shard or drop "
                "parallelism_config from the accelerate config"
            ])
        return strategy, (rep, shard), [], [f"its HSDP parallelism_config (dp_replicate_size={rep}, dp_shard_size="
                                            f"{shard}) applies as well (accelerate reads it from the environment)"]
    return strategy, None, [], [f"its HSDP parallelism_config (dp_replicate_size={rep}) is not used: fsdp.strategy = "
                                f"{strategy!r}"]


def _mesh(strategy: str, world: int, groups: tuple[int, int], launcher_hsdp: bool = False) -> tuple[Mesh, list[str]]:
    """The device mesh of ``strategy``; ``groups`` = (replica groups, ranks in each) for a 2-D one."""
    nodes, local = groups
    if strategy == "hybrid_shard":
        if nodes == 0:
            raise SpeedupConfigError([
                f"fsdp.strategy = 'hybrid_shard' needs the world size ({world}) to be a multiple of the processes "
                f"per node (LOCAL_WORLD_SIZE={local}); allowed: full_shard, shard_grad_op, no_shard; fix: launch the "
                "same number of processes on every node or set fsdp.strategy: full_shard"
            ])
        one_node = [f"hybrid_shard on one node = full_shard (replicate groups: 1, shard group: {local})"]
        return Mesh((nodes, local), HSDP_DIMS), one_node if nodes == 1 else []
    if strategy == "no_shard":  # FSDP2's NO_SHARD: a shard dimension of size 1
        return Mesh((world, 1), HSDP_DIMS), []
    if launcher_hsdp:  # accelerate applies the launch config's HSDP whatever the strategy
        return Mesh((nodes, local), HSDP_DIMS), []
    return Mesh((world,), ("dp_shard",)), []


def _accelerate_limits(version: int, strategy: str, mesh: Mesh,
                       parallelism_config: bool) -> tuple[int, tuple[int, int] | None, list[str]]:
    """(version, HSDP parallelism, fallbacks): accelerate's FSDP2 has no NO_SHARD and does HSDP only through
    a ParallelismConfig (``parallelism_config``: TrainingArguments has that field); FSDP1 where they miss."""
    if version != 2:
        return version, None, []
    if strategy == "no_shard":
        return 1, None, ["fsdp.version 2 -> 1: accelerate's FSDP2 has no NO_SHARD; FSDP1 NO_SHARD used"]
    if strategy == "hybrid_shard":
        if parallelism_config:
            return 2, mesh.shape, []
        return 1, None, ["fsdp.version 2 -> 1: this transformers has no TrainingArguments.parallelism_config "
                         "(HSDP under FSDP2); FSDP1 HYBRID_SHARD used"]
    return 2, None, []


# ------------------------------------------------------------------------------------------ hand-offs
def _mixed_precision(ctx: PlanContext) -> MixedPrecision | None:
    """The precision decision's reduced compute dtype (bf16/fp16) for the all-gathers; None for fp32."""
    d = ctx.decisions.get("precision")
    if d is None or d.settings.dtype == torch.float32:
        return None
    return MixedPrecision(param_dtype=d.settings.dtype)


def _activation_checkpointing(ck, backend: str) -> tuple[str | None, str]:
    """(who checkpoints the blocks: "fsdp" | "checkpointing" | None, why): done once, never by both."""
    if ck.enabled is True and backend == "accelerate" and ck.every_n_blocks == 1:
        return "fsdp", "FSDP's own activation checkpointing (fsdp_config, non-reentrant), not the Trainer's"
    if ck.enabled in (True, "auto"):
        return "checkpointing", ("left to the checkpointing feature (non-reentrant, applied before sharding)"
                                 + ("; every_n_blocks > 1 is not expressible in fsdp_config"
                                    if backend == "accelerate" else ""))
    return None, "off"


def _wrap(ctx: PlanContext) -> tuple[Wrap, list[str]]:
    """One FSDP unit per block of every block class the block finder found (a vision-language model has two:
    naming one would replace accelerate's default of all ``_no_split_modules``), then embeddings, head and root."""
    model = ctx.model
    block = model.block_class if model is not None else None
    classes = tuple(getattr(model, "block_classes", ()) or ((block,) if block else ()))
    fallbacks = []
    if model is not None and not block:
        fallbacks.append("no repeated decoder block found: only the root is sharded (one unit, no overlap)")
    units = f"each {', '.join(classes)}" if classes else "each decoder block" if model is None else "no block"
    return Wrap(block_class=block, blocks=model.num_blocks if model is not None else 0,
                units=units + " + embeddings + final norm/lm_head + root", block_classes=classes), fallbacks


# ------------------------------------------------------------------------------------------ reason
def _notes(s: FsdpSettings, backend: str, user_fsdp: str | None, launcher: dict,
           launcher_notes: list[str]) -> list[str]:
    """What the reason adds: offload and loading effects, what the preset replaces or overrides."""
    notes = []
    if backend == "hf_speedup" and s.cpu_offload:
        notes.append("cpu_offload on CPU: parameters already live in host memory (offload policy set, saves nothing)")
    if s.cpu_ram_efficient_loading:
        if backend == "hf_speedup":
            notes.append("rank 0's weights are broadcast to every rank when sharding")
        elif not ram_efficient_loading_set():
            notes.append("cpu_ram_efficient_loading: set FSDP_CPU_RAM_EFFICIENT_LOADING=true before from_pretrained "
                         "(accelerate launch does so from the YAML) so only rank 0 reads the weights")
    if user_fsdp:
        notes.append(f"replaces TrainingArguments.fsdp={user_fsdp!r}")
    if launcher.get("enabled"):
        where = "take precedence over it" if backend == "accelerate" else "apply (accelerate's FSDP is off on CPU)"
        notes.append(f"the accelerate launch config enables FSDP too; the preset's settings {where}"
                     + (f" — it differs: {', '.join(launcher_notes)}" if launcher_notes else ""))
    return notes


def _layout(st: Settings) -> str:
    """HSDP's mesh in words: which dimension runs across nodes, which within one."""
    if st.strategy != "hybrid_shard" or len(st.mesh.shape) != 2:
        return ""
    (replicas, shard), names = st.mesh.shape, st.mesh.dim_names
    return (f" ({replicas} node(s) x {shard} process(es): mesh {names[0]}={replicas} x {names[1]}={shard}, sharded "
            "within a node, replicated across nodes)")


def _reason(st: Settings, world: int, ac_why: str, notes: list[str]) -> str:
    how = "hf_speedup fully_shard (accelerate shards only on accelerators)" if st.backend == "hf_speedup" else \
        "accelerate via TrainingArguments.fsdp_config"
    mp = st.mixed_precision
    mp_txt = f", mixed precision param {long_name(mp.param_dtype)}/reduce float32" if mp is not None else ""
    lora_txt = ", LoRA adapters sharded with their blocks" if st.lora else ""
    reason = (f"FSDP{st.version} {st.strategy} over {world} rank(s){_layout(st)} by {how}; wrap: {st.wrap.units}"
              f"{mp_txt}{lora_txt}; activation checkpointing: {ac_why}; state dict: {st.state_dict_type}")
    return reason + ("; " + "; ".join(notes) if notes else "")
