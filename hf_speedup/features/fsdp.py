"""FSDP sharding of the decoder blocks — through accelerate on GPUs, by hf_speedup itself on CPU.

Two backends, one decision:

- ``accelerate`` (CUDA, XPU): the Trainer's own FSDP, turned on through TrainingArguments
  (``fsdp`` + ``fsdp_config`` with ``version: 2``, ``transformer_layer_cls_to_wrap`` = the block class the
  block finder found, ``reshard_after_forward``, ``cpu_offload``, ``state_dict_type``...; HSDP through
  ``parallelism_config``). accelerate shards when ``train()`` starts; verify runs again then.
- ``hf_speedup`` (CPU, gloo): accelerate enables FSDP only on accelerators, so the stock Trainer would
  silently train with DDP. hf_speedup shards with FSDP2 ``fully_shard`` itself (``sharding.py``) and keeps
  the Trainer from wrapping the sharded model (``sharding.FsdpTrainerMixin``).

Strategies under FSDP2: ``full_shard`` = ``reshard_after_forward=True``; ``shard_grad_op`` = ``False``;
``hybrid_shard`` = a 2-D mesh (replicate across nodes, shard within one); ``no_shard`` = a mesh whose
shard dimension has size 1 (parameters replicated, gradients all-reduced: DDP semantics). Through
accelerate, ``no_shard`` needs FSDP1 (explicit fallback, reported).

Hand-offs to other features, in ``settings``: ``activation_checkpointing`` is True when FSDP itself
checkpoints the blocks (``fsdp_config``, accelerate backend) and the checkpointing feature must not;
``activation_checkpointing_by`` names who does it ("fsdp" | "checkpointing" | None) — done once;
``qlora.bnb_4bit_quant_storage`` is the storage dtype 4-bit weights need to be shardable.

World size 1: on CPU there is nothing to shard across (off, with the reason). On one GPU FSDP is legit
(it exercises NCCL and the sharded checkpoint path) when launched with ``torchrun``/``accelerate launch``.
"""

from __future__ import annotations

import logging
import os

from .. import compat
from ..config import SpeedupConfigError
from ..plan import Decision, PlanContext

NAME = "fsdp"
logger = logging.getLogger("hf_speedup")

_COMPUTE = {"bf16": "bfloat16", "fp16": "float16"}


# --------------------------------------------------------------------------------------------- decide
def _launched() -> bool:
    """Started by torchrun / accelerate launch (even with one process)."""
    return "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ


def _local_world_size(world: int) -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    except ValueError:
        return world


def _compute_dtype(ctx: PlanContext) -> str | None:
    """The precision decision's dtype as a torch dtype name ("bfloat16"/"float16"), None for fp32."""
    d = ctx.decisions.get("precision")
    if d is None:
        return None
    dtype = (d.settings or {}).get("dtype")
    if dtype is None:
        text = str(d.applied).lower()
        dtype = "bf16" if "bf16" in text else "fp16" if "fp16" in text else "fp32"
    return _COMPUTE.get(dtype)


def _lora_state(ctx: PlanContext) -> tuple[bool, str | None]:
    """(LoRA adapters in the model, quantization of the base: None | "4bit" | "8bit")."""
    d = ctx.decisions.get("lora")
    model_q = ctx.model.quantization if ctx.model is not None else None
    lora_on = bool((d is not None and d.active) or (ctx.model is not None and ctx.model.is_peft))
    q = None
    if d is not None and d.active:
        st = d.settings or {}
        q = st.get("quantization")
        if q is None:
            text = str(d.applied).lower()
            q = "4bit" if ("qlora" in text or "4bit" in text) else "8bit" if "8bit" in text else None
    return lora_on, q or (model_q if model_q in ("4bit", "8bit") else None)


def _user_fsdp(args) -> str | None:
    value = getattr(args, "fsdp", None) if args is not None else None
    return str(value) if value not in (None, "", False, []) else None


def _env_bool(name: str) -> bool | None:
    v = os.environ.get(name)
    return None if v is None else v.strip().lower() in ("1", "true", "yes")


def launcher_fsdp() -> dict:
    """What ``accelerate launch --config_file`` asked for (its FSDP_* / PARALLELISM_CONFIG_* env), or {}."""
    out: dict = {}
    if _env_bool("ACCELERATE_USE_FSDP"):
        out["enabled"] = True
        for key, env in (("version", "FSDP_VERSION"), ("state_dict_type", "FSDP_STATE_DICT_TYPE"),
                         ("reshard_after_forward", "FSDP_RESHARD_AFTER_FORWARD")):
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


def _launcher_differences(launcher: dict, s) -> list[str]:
    diffs = []
    if "version" in launcher and str(launcher["version"]) != str(s.version):
        diffs.append(f"fsdp_version={launcher['version']} (preset: {s.version})")
    if launcher.get("cpu_offload") is not None and launcher["cpu_offload"] != s.cpu_offload:
        diffs.append(f"fsdp_offload_params={str(launcher['cpu_offload']).lower()} "
                     f"(preset: {str(s.cpu_offload).lower()})")
    if "state_dict_type" in launcher:
        want = "SHARDED_STATE_DICT" if s.state_dict_type == "sharded" else "FULL_STATE_DICT"
        if launcher["state_dict_type"].upper() != want:
            diffs.append(f"fsdp_state_dict_type={launcher['state_dict_type']} (preset: {want})")
    return diffs


def _off(requested, reason: str, fallbacks: list | None = None) -> Decision:
    return Decision(NAME, requested=requested, applied="off", reason=reason, fallbacks=list(fallbacks or []))


def decide(ctx: PlanContext) -> Decision:
    s, caps, args = ctx.config.fsdp, ctx.caps, ctx.args
    user_fsdp = _user_fsdp(args)
    device = "cpu" if (caps.device_type == "cpu" or getattr(args, "use_cpu", False)) else caps.device_type
    if not s.enabled:
        if user_fsdp and device == "cpu" and caps.world_size > 1:
            why = (f"off: TrainingArguments.fsdp={user_fsdp!r} does NOT shard on CPU — accelerate enables FSDP only on "
                   "accelerators, so the Trainer trains with plain DDP (every rank holds the whole model); fix: use "
                   "speedup='fsdp' (hf_speedup shards with FSDP2 on CPU)")
            logger.warning("hf_speedup fsdp: %s", why)
            return _off(False, why, [why])
        if user_fsdp:
            return _off(False, f"not requested by hf_speedup; TrainingArguments.fsdp={user_fsdp!r} is yours "
                               "(the Trainer/accelerate shards)")
        return _off(False, "not requested (fsdp.enabled: false)")

    requested = {"version": s.version, "strategy": s.strategy, "cpu_offload": s.cpu_offload,
                 "state_dict_type": s.state_dict_type}
    fallbacks: list[str] = []
    lora_on, quant = _lora_state(ctx)
    if quant == "8bit":
        raise SpeedupConfigError([
            "fsdp.enabled = true with an 8-bit bitsandbytes base (lora.quantization = '8bit'): FSDP cannot shard "
            "Int8 weights; allowed with FSDP: lora.quantization: null or '4bit' (QLoRA, with bnb_4bit_quant_storage "
            "= the compute dtype); fix: set lora.quantization: '4bit' or fsdp.enabled: false"
        ])

    world = caps.world_size
    if device == "cpu":
        backend = "hf_speedup"
        if world <= 1:
            why = ("world size 1: FSDP on one CPU process has nothing to shard across; launch several processes, "
                   "e.g. torchrun --nproc_per_node 2 train.py (note: accelerate launch --cpu starts one process "
                   "without mpirun; use accelerate launch --multi_gpu --num_processes 2 on a CPU machine)")
            return _off(requested, f"off: {why}", [f"fsdp: {why}"])
    elif device in ("cuda", "xpu"):
        backend = "accelerate"
        if not _launched():
            why = (f"one {device.upper()} process not started by a distributed launcher: the Trainer's FSDP needs a "
                   "process group; run torchrun --nproc_per_node 1 ... or accelerate launch --num_processes 1 ... "
                   "(FSDP on one GPU exercises NCCL and sharded checkpoints; it saves no memory)")
            return _off(requested, f"off: {why}", [f"fsdp: {why}"])
    else:
        why = f"FSDP is not supported on {device} (needs CUDA/XPU through accelerate, or CPU processes over gloo)"
        return _off(requested, f"off: {why}", [f"fsdp: {why}"])

    version = s.version
    ok2, why2 = compat.fsdp2_support()
    if version == 2 and not ok2:
        if backend == "hf_speedup":
            return _off(requested, f"off: {why2} (hf_speedup shards CPU runs with FSDP2 only)", [f"fsdp: {why2}"])
        version = 1
        fallbacks.append(f"fsdp.version 2 -> 1: {why2}")
    if version == 1 and backend == "hf_speedup":
        if not ok2:
            return _off(requested, f"off: {why2}", [f"fsdp: {why2}"])
        version = 2
        fallbacks.append("fsdp.version 1 -> 2: on CPU hf_speedup shards with FSDP2 fully_shard (FSDP1 on CPU is not "
                         "wired; FSDP2 gives the same sharding)")

    strategy = s.strategy
    local = _local_world_size(world)
    nodes = max(1, world // local) if world % local == 0 else 0
    launcher = launcher_fsdp()
    launcher_notes = _launcher_differences(launcher, s)
    rep, shard = launcher.get("dp_replicate_size", 1), launcher.get("dp_shard_size", 0)
    if rep > 1 and strategy in ("full_shard", "hybrid_shard"):
        if rep * shard != world:
            raise SpeedupConfigError([
                f"the accelerate launch config asks for HSDP with dp_replicate_size={rep} x dp_shard_size={shard}, "
                f"but {world} processes run; allowed: a product equal to num_processes; fix: set "
                f"parallelism_config_dp_shard_size: {max(1, world // rep)} in the accelerate config"
            ])
        if strategy == "full_shard":
            fallbacks.append(f"fsdp.strategy full_shard -> hybrid_shard: the accelerate launch config asks for HSDP "
                             f"(dp_replicate_size={rep}, dp_shard_size={shard})")
        strategy, nodes, local = "hybrid_shard", rep, shard
    elif rep > 1 and backend == "accelerate":
        if strategy == "no_shard":
            raise SpeedupConfigError([
                f"fsdp.strategy = 'no_shard' conflicts with the accelerate launch config's HSDP parallelism_config "
                f"(dp_replicate_size={rep}), which accelerate applies from the environment; allowed together: "
                "full_shard, shard_grad_op, hybrid_shard; fix: set fsdp.strategy: hybrid_shard or drop "
                "parallelism_config from the accelerate config"
            ])
        launcher_notes.append(f"its HSDP parallelism_config (dp_replicate_size={rep}, dp_shard_size={shard}) applies "
                              "as well (accelerate reads it from the environment)")
    elif rep > 1:
        launcher_notes.append(f"its HSDP parallelism_config (dp_replicate_size={rep}) is not used: fsdp.strategy = "
                              f"{strategy!r}")
    if strategy == "hybrid_shard" and nodes == 0:
        raise SpeedupConfigError([
            f"fsdp.strategy = 'hybrid_shard' needs the world size ({world}) to be a multiple of the processes per "
            f"node (LOCAL_WORLD_SIZE={local}); allowed: full_shard, shard_grad_op, no_shard; fix: launch the same "
            "number of processes on every node or set fsdp.strategy: full_shard"
        ])
    parallelism = None  # (replicate, shard) for accelerate's ParallelismConfig
    if strategy == "hybrid_shard":
        mesh = {"shape": [nodes, local], "dim_names": ["dp_replicate", "dp_shard"]}
        if nodes == 1:
            fallbacks.append(f"hybrid_shard on one node = full_shard (replicate groups: 1, shard group: {local})")
    elif strategy == "no_shard":
        mesh = {"shape": [world, 1], "dim_names": ["dp_replicate", "dp_shard"]}
    elif rep > 1 and backend == "accelerate":
        mesh = {"shape": [rep, shard], "dim_names": ["dp_replicate", "dp_shard"]}
    else:
        mesh = {"shape": [world], "dim_names": ["dp_shard"]}
    if backend == "accelerate" and version == 2:
        if strategy == "no_shard":
            version = 1
            fallbacks.append("fsdp.version 2 -> 1: accelerate's FSDP2 has no NO_SHARD; FSDP1 NO_SHARD used")
        elif strategy == "hybrid_shard":
            if compat.args_support_parallelism_config(type(args) if args is not None else None):
                parallelism = (nodes, local)
            else:
                version = 1
                fallbacks.append("fsdp.version 2 -> 1: this transformers has no TrainingArguments.parallelism_config "
                                 "(HSDP under FSDP2); FSDP1 HYBRID_SHARD used")

    compute = _compute_dtype(ctx)
    mixed = {"param_dtype": compute, "reduce_dtype": "float32"} if compute else None

    ck = ctx.config.checkpointing
    if ck.enabled is True and backend == "accelerate" and ck.every_n_blocks == 1:
        ac = "fsdp"
        ac_why = "FSDP's own activation checkpointing (fsdp_config, non-reentrant), not the Trainer's"
    elif ck.enabled in (True, "auto"):
        ac = "checkpointing"
        ac_why = ("left to the checkpointing feature (non-reentrant, applied before sharding)"
                  + ("; every_n_blocks > 1 is not expressible in fsdp_config" if backend == "accelerate" else ""))
    else:
        ac, ac_why = None, "off"

    block = ctx.model.block_class if ctx.model is not None else None
    nblocks = ctx.model.num_blocks if ctx.model is not None else 0
    if ctx.model is not None and not block:
        fallbacks.append("no repeated decoder block found: only the root is sharded (one unit, no overlap)")

    settings: dict = {
        "backend": backend,
        "version": version,
        "strategy": strategy,
        "reshard_after_forward": strategy != "shard_grad_op",
        "mesh": mesh,
        "wrap": {"block_class": block, "blocks": nblocks,
                 "units": (f"each {block}" if block else "each decoder block" if ctx.model is None else "no block")
                 + " + embeddings + final norm/lm_head + root"},
        "cpu_offload": s.cpu_offload,
        "mixed_precision": mixed,
        # truthy = FSDP itself checkpoints the blocks (read by the checkpointing feature: done once, there)
        "activation_checkpointing": ac == "fsdp",
        "activation_checkpointing_by": ac,
        "checkpoint_use_reentrant": False,
        "state_dict_type": s.state_dict_type,
        "cpu_ram_efficient_loading": s.cpu_ram_efficient_loading,
        "lora": lora_on,
    }
    if parallelism:
        settings["parallelism"] = {"dp_replicate_size": parallelism[0], "dp_shard_size": parallelism[1]}
    if quant == "4bit":
        settings["qlora"] = {"bnb_4bit_quant_storage": compute or "bfloat16",
                             "why": "FSDP shards 4-bit weights only when they are stored in the dtype of the other "
                                    "parameters (uint8 storage is left unsharded)"}
    notes = []
    if backend == "hf_speedup" and s.cpu_offload:
        notes.append("cpu_offload on CPU: parameters already live in host memory (offload policy set, saves nothing)")
    if s.cpu_ram_efficient_loading:
        if backend == "hf_speedup":
            notes.append("rank 0's weights are broadcast to every rank when sharding")
        elif os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "").lower() not in ("1", "true"):
            notes.append("cpu_ram_efficient_loading: set FSDP_CPU_RAM_EFFICIENT_LOADING=true before from_pretrained "
                         "(accelerate launch does so from the YAML) so only rank 0 reads the weights")
    if user_fsdp:
        notes.append(f"replaces TrainingArguments.fsdp={user_fsdp!r}")
    if launcher.get("enabled"):
        where = "take precedence over it" if backend == "accelerate" else "apply (accelerate's FSDP is off on CPU)"
        notes.append(f"the accelerate launch config enables FSDP too; the preset's settings {where}"
                     + (f" — it differs: {', '.join(launcher_notes)}" if launcher_notes else ""))

    how = "hf_speedup fully_shard (accelerate shards only on accelerators)" if backend == "hf_speedup" else \
        "accelerate via TrainingArguments.fsdp_config"
    mp_txt = f", mixed precision param {compute}/reduce float32" if compute else ""
    lora_txt = ", LoRA adapters sharded with their blocks" if lora_on else ""
    reason = (f"FSDP{version} {strategy} over {world} rank(s) by {how}; wrap: {settings['wrap']['units']}"
              f"{mp_txt}{lora_txt}; activation checkpointing: {ac_why}; state dict: {s.state_dict_type}")
    if notes:
        reason += "; " + "; ".join(notes)
    for fb in fallbacks:
        logger.warning("hf_speedup fsdp fallback: %s", fb)
    return Decision(NAME, requested=requested, applied=f"fsdp{version}", reason=reason, settings=settings,
                    fallbacks=fallbacks)


# --------------------------------------------------------------------------------------------- apply
def fsdp_config(settings: dict) -> dict:
    """The TrainingArguments ``fsdp_config`` (5.x key names) for the accelerate backend."""
    version = settings["version"]
    cfg: dict = {
        "version": version,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "cpu_offload": bool(settings["cpu_offload"]),
        "state_dict_type": "SHARDED_STATE_DICT" if settings["state_dict_type"] == "sharded" else "FULL_STATE_DICT",
        "cpu_ram_efficient_loading": bool(settings["cpu_ram_efficient_loading"]),
        "activation_checkpointing": bool(settings.get("activation_checkpointing")),
    }
    block = (settings.get("wrap") or {}).get("block_class")
    if block:
        cfg["transformer_layer_cls_to_wrap"] = [block]
    if version == 2:
        cfg["reshard_after_forward"] = bool(settings["reshard_after_forward"])
    else:
        cfg["reshard_after_forward"] = settings["strategy"]  # FSDP1: the ShardingStrategy name
        cfg["use_orig_params"] = True  # LoRA (mixed requires_grad) and torch.compile need the original params
        cfg["sync_module_states"] = bool(settings["cpu_ram_efficient_loading"])
        cfg["backward_prefetch"] = "BACKWARD_PRE"
        cfg["forward_prefetch"] = False
    return cfg


def training_args(decision: Decision, args) -> dict:
    st = decision.settings
    if not decision.active or st.get("backend") != "accelerate":
        return {}  # the hf_speedup backend shards in SpeedupTrainer; TrainingArguments cannot express it
    out = compat.fsdp_training_args(fsdp_config(st), st["strategy"], bool(st["cpu_offload"]),
                                    type(args) if args is not None else None)
    par = st.get("parallelism")
    if par:
        from accelerate import ParallelismConfig

        out["parallelism_config"] = ParallelismConfig(**par)
    return out


def apply(decision: Decision, setup) -> None:
    """Checks that need the model; the sharding itself happens when the Trainer is built (after every feature).

    hf_speedup backend: ``SpeedupTrainer`` (``sharding.FsdpTrainerMixin``) calls ``fully_shard`` right after
    the Accelerator exists, so LoRA adapters, activation checkpointing and compiled regions are in place first.
    """
    if not decision.active:
        return
    import torch

    model = setup.model
    if model is None:
        return
    packed = [n for n, p in model.named_parameters() if type(p).__name__ == "Params4bit" and p.dtype == torch.uint8]
    if packed:
        want = (decision.settings.get("qlora") or {}).get("bnb_4bit_quant_storage", "bfloat16")
        raise SpeedupConfigError([
            f"fsdp with a 4-bit base: {len(packed)} weight(s) (e.g. {packed[0]}) are stored as uint8, which FSDP "
            f"leaves unsharded; fix: load with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=torch."
            f"{want}) (the dtype of the other parameters)"
        ])
    if decision.settings.get("backend") == "hf_speedup":
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if len(dtypes) > 1 and not decision.settings.get("mixed_precision"):
            logger.warning("hf_speedup fsdp: parameters have several dtypes (%s); FSDP2 all-gathers each unit in "
                           "one dtype", ", ".join(sorted(str(d) for d in dtypes)))


# --------------------------------------------------------------------------------------------- verify
def verify(decision: Decision, trainer) -> tuple[bool, str]:
    if not decision.active:
        return False, decision.reason
    from ..sharding import describe, sharding_summary

    st = decision.settings
    model = trainer.model
    summary = sharding_summary(model)
    st["verified"] = {k: v for k, v in summary.items() if k != "this_rank"}
    wrapped = type(getattr(trainer, "model_wrapped", model)).__name__
    if "DistributedDataParallel" in wrapped:
        return False, f"NOT sharded: the Trainer wrapped the model in {wrapped}"
    if not summary["dtensor_parameters"] and summary.get("fsdp_version") != 1:
        if st["backend"] == "accelerate":
            if getattr(trainer, "is_fsdp_enabled", False):
                return False, "accelerate FSDP plugin active; the parameters are sharded when train() starts " \
                              "(verified again then)"
            dtype = getattr(getattr(trainer, "accelerator", None), "distributed_type", "?")
            return False, f"NOT sharded: accelerate did not enable FSDP (distributed_type={dtype})"
        return False, "NOT sharded: no parameter is a DTensor"
    text = describe(summary, st["strategy"])
    if summary["plain_parameters"]:
        return False, f"{text}; but {summary['plain_parameters']} parameter(s) are not sharded (plain tensors)"
    if st.get("cpu_offload") and st["backend"] == "accelerate" and summary.get("local_shard_devices") \
            and summary["local_shard_devices"] != ["cpu"]:
        text += f"; CPU offload NOT in force (shards on {', '.join(summary['local_shard_devices'])})"
        return False, text
    if st.get("cpu_offload") and summary.get("local_shard_devices") == ["cpu"] and st["backend"] == "accelerate":
        text += ", shards offloaded to CPU"
    if st["strategy"] == "no_shard":
        return True, f"{text} (replicated on purpose: no_shard)"
    if summary["world_size"] == 1:
        return True, f"{text} (world size 1: nothing to shard across; FSDP hooks, NCCL and sharded checkpoints in use)"
    if not summary["sharded"]:
        return False, f"{text}: every rank holds the whole model"
    return True, text
