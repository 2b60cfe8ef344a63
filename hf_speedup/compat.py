"""Version differences of transformers / accelerate / torch, in one place.

Only shims live here: code that papers over what one version of a dependency spells, keeps or lacks
differently from another, so the rest of the package is written once against the newest API.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

# --------------------------------------------------------------------------- transformers / accelerate


CACHE_KWARGS = ("cache", "past_key_values", "past_key_value")  # transformers >= 5.24 names the KV cache ``cache``


def kv_cache_arg(kwargs: dict):
    """The KV cache a model or decoder-layer call was given, under whichever name this transformers uses."""
    return next((kwargs[k] for k in CACHE_KWARGS if kwargs.get(k) is not None), None)


def args_fields(args_cls=None) -> set[str]:
    if args_cls is None:
        from transformers import TrainingArguments as args_cls
    return {f.name for f in dataclasses.fields(args_cls)}


def checkpointing_arg_names(args_cls=None) -> tuple[str, str]:
    """(flag, kwargs) names: ``activation_checkpointing*`` in newer transformers, else ``gradient_checkpointing*``."""
    fields = args_fields(args_cls)
    if "activation_checkpointing" in fields:
        return "activation_checkpointing", "activation_checkpointing_kwargs"
    return "gradient_checkpointing", "gradient_checkpointing_kwargs"


def is_trl_sft_config(args) -> bool:
    """TRL's ``SFTConfig`` (or a subclass), read off the class names so that planning never imports TRL."""
    return any(c.__name__ == "SFTConfig" and c.__module__.startswith("trl") for c in type(args).__mro__)


def replace_args(args, overrides: dict):
    """A copy of TrainingArguments with ``overrides``; the user's object is never mutated."""
    if not overrides:
        return args
    fields = args_fields(type(args))
    unknown = [k for k in overrides if k not in fields]
    if unknown:
        raise TypeError(f"TrainingArguments of this transformers version has no field(s) {unknown}")
    init_fields = {f.name for f in dataclasses.fields(args) if f.init}
    values = {k: getattr(args, k) for k in init_fields}
    _reset_derived_fields(values, overrides)
    values.update(overrides)
    return type(args)(**values)


@contextlib.contextmanager
def accelerate_state_kept():
    """Build TrainingArguments inside it without breaking a Trainer that already exists: accelerate's
    ``AcceleratorState``, ``PartialState`` and ``GradientState`` are process-wide (every instance's ``__dict__`` is
    its class's ``_shared_state``), and ``TrainingArguments._setup_devices`` (run by its ``__post_init__``) clears the
    first two and sets up a fresh ``PartialState``, so a live Accelerator loses ``distributed_type``. Afterwards each
    dict holds again what it held before (the same dict objects, so live instances see their state again)."""
    try:
        from accelerate.state import AcceleratorState, GradientState, PartialState
    except ImportError:  # pragma: no cover - accelerate is a dependency of the Trainer
        yield
        return
    saved = [(cls._shared_state, dict(cls._shared_state)) for cls in (AcceleratorState, PartialState, GradientState)]
    try:
        yield
    finally:
        for shared, before in saved:
            shared.clear()
            shared.update(before)


# (derived, source): a config's ``__post_init__`` fills ``derived`` from ``source`` (and the batch shape) when it
# is left None, fills both when both are None, and refuses both set. TRL's GRPOConfig, RLOOConfig and the
# experimental GMPO/SDFT/SDPO configs: generation_batch_size = per_device_train_batch_size * world *
# steps_per_generation (steps_per_generation defaults to gradient_accumulation_steps).
DERIVED_FIELDS = (("generation_batch_size", "steps_per_generation"),)


def _reset_derived_fields(values: dict, overrides: dict) -> None:
    """A built config holds both fields of a derived pair (one given, one filled in), which its own
    ``__post_init__`` then rejects on a rebuild: reset the one the overrides do not set (``derived`` when
    neither), so it is filled in again from the other and the rebuilt config keeps every value."""
    for derived, source in DERIVED_FIELDS:
        if values.get(derived) is None or values.get(source) is None:
            continue
        if derived in overrides and source not in overrides:
            values[source] = None
        elif source in overrides or derived not in overrides:
            values[derived] = None


def enable_model_checkpointing(model, kwargs: dict) -> None:
    """``activation_checkpointing_enable`` (new) or ``gradient_checkpointing_enable`` (old)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def gradient_checkpointing_layer_cls():
    """transformers' ``GradientCheckpointingLayer`` (>= 4.52), or None on older versions."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def remove_quantization_config(quantizer, model) -> None:
    """Detach ``quantizer`` from ``model`` with the quantizer's own method, or by hand where this transformers lacks it."""
    if hasattr(quantizer, "remove_quantization_config"):
        quantizer.remove_quantization_config(model)
        return
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            delattr(model, attr)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False


def gguf_dequantize_config():
    """``GgufConfig(dequantize=True)`` where transformers has it (5.x); None where GGUF is always dequantized."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return None
    return GgufConfig(dequantize=True)


def unwrap_optimizer(opt: Any) -> Any:
    """accelerate wraps the optimizer; the real one is ``.optimizer`` (possibly nested)."""
    seen = 0
    while hasattr(opt, "optimizer") and seen < 5:
        opt = opt.optimizer
        seen += 1
    return opt


def dynamo_recompile_limit(config: Any = None) -> int | None:
    """How many graphs dynamo compiles for one frame before running it eager: ``recompile_limit`` (torch >= 2.7),
    ``cache_size_limit`` (torch 2.6, where the new name does not exist)."""
    if config is None:
        try:
            import torch._dynamo.config as config
        except ImportError:
            return None
    for name in ("recompile_limit", "cache_size_limit"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return None


# --------------------------------------------------------------------------- TF32 / caching allocator


# torch < 2.9 has one API: ``torch.set_float32_matmul_precision`` ("high" = TF32 for cuBLAS; ``allow_tf32`` is
# the same flag) and ``torch.backends.cudnn.allow_tf32``. torch >= 2.9 adds ``fp32_precision`` per backend and
# op ("tf32" | "ieee" | "none" = inherit) plus a process-wide ``torch.backends.fp32_precision``, and keeps the
# legacy calls as a view of it: the legacy setters write both generations, but a value set only through the
# new API makes the legacy getters raise ("mix of the legacy and new APIs"). transformers' ``enable_tf32``
# (TrainingArguments' ``tf32``, ``torch_compile``) sets the process-wide new value; inductor reads both
# ``torch.get_float32_matmul_precision()`` (GEMM autotuning keys) and
# ``torch.backends.cuda.matmul.fp32_precision``. So TF32 is set through the legacy setters, which every reader
# then agrees with, and read through :func:`tf32_matmul_state`.

_NEW_TF32_API = hasattr(torch.backends, "fp32_precision")  # torch >= 2.9


def tf32_matmul_state() -> tuple[bool, str]:
    """(TF32 on for CUDA fp32 matmuls and readable the way inductor reads it, what each API answers).

    False when the APIs disagree or ``torch.get_float32_matmul_precision()`` raises: inductor's GEMM
    autotuning calls it for every matmul it compiles, so such a state fails the compile.
    """
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:
        new = _fp32_precision(torch.backends.cuda.matmul)
        return False, (f"torch.get_float32_matmul_precision() raises (fp32_precision={new!r} was set through torch's "
                       "new API alone, as transformers' enable_tf32 does): inductor's GEMM autotuning reads it and "
                       "fails; fix: set TF32 with torch.set_float32_matmul_precision('high')")
    text = f"torch.get_float32_matmul_precision()={legacy!r}"
    on = legacy != "highest"
    if _NEW_TF32_API:
        new = _fp32_precision(torch.backends.cuda.matmul)
        text += f", torch.backends.cuda.matmul.fp32_precision={new!r}"
        if new not in (None, "none") and (new == "tf32") != on:
            return False, text + " (the two APIs disagree: cuBLAS follows fp32_precision)"
    return on, text


def _fp32_precision(backend) -> str | None:
    try:
        return getattr(backend, "fp32_precision", None)
    except RuntimeError:
        return None


def tf32_matmul_enabled() -> bool:
    """Whether fp32 CUDA matmuls may use TF32, read as inductor reads it (see :func:`tf32_matmul_state`)."""
    return tf32_matmul_state()[0]


def set_tf32(enable: bool) -> None:
    """TF32 for CUDA fp32 matmuls and cuDNN convolutions, one way on every torch: through the legacy setters,
    which torch >= 2.9 mirrors into the new per-backend values, so both API generations read the same.

    A process-wide ``torch.backends.fp32_precision`` left by transformers' ``enable_tf32`` is reset first
    (it also reaches the CPU's oneDNN, and with it the legacy getter raises), and the oneDNN matmul value that
    the legacy matmul setter writes too is put back: this switch is for CUDA only.
    """
    onednn = None
    if _NEW_TF32_API:
        if torch.backends.fp32_precision != "none":
            torch.backends.fp32_precision = "none"
        onednn = _fp32_precision(torch.backends.mkldnn.matmul)
    torch.set_float32_matmul_precision("high" if enable else "highest")
    torch.backends.cudnn.allow_tf32 = enable
    if onednn is not None:
        torch.backends.mkldnn.matmul.fp32_precision = onednn


def get_allocator_settings() -> str | None:
    """The caching-allocator settings string in force (torch >= 2.9), or None where torch cannot say."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is None:
        return None
    try:
        return getter()
    except RuntimeError:
        return None


def set_allocator_settings(conf: str) -> bool:
    """Change caching-allocator settings at run time (applies to segments allocated from now on)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch < 2.9: the CUDA-only (now deprecated) spelling
        setter = getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None)
    if setter is None:
        return False
    setter(conf)
    return True


# --------------------------------------------------------------------------- FSDP1 / FSDP2
#
# torch:        FSDP2 ``fully_shard`` is public in ``torch.distributed.fsdp`` from 2.6 (2.4-2.5 had it under
#               ``torch.distributed._composable.fsdp``); ``DTensor`` in ``torch.distributed.tensor`` from 2.5.
# accelerate:   ``FullyShardedDataParallelPlugin(fsdp_version=2)`` (>= 1.6); FSDP2 takes ``reshard_after_forward``
#               as a bool, FSDP1 as a strategy name; HSDP under FSDP2 needs ``ParallelismConfig`` (>= 1.10).
#               FSDP is enabled only on accelerators: under ``use_cpu``/no GPU the Trainer runs DDP instead.
# transformers: 5.x takes ``fsdp=True`` with everything else in ``fsdp_config`` (``version``,
#               ``reshard_after_forward``, ``cpu_offload``, ...); 4.x took the options as a string
#               (``fsdp="full_shard auto_wrap offload"``), still accepted (deprecated) by 5.x. FSDP1
#               (``fsdp_config['version'] = 1``) is deprecated in 5.x; FSDP2 is its default.

FSDP2_MIN_TORCH = (2, 6)


def _torch_version() -> tuple[int, int]:
    parts = torch.__version__.split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def fully_shard_fn():
    """``fully_shard`` wherever this torch keeps it, or None."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import fully_shard  # torch 2.4-2.5
        except ImportError:
            return None
    return fully_shard


def fsdp_module_cls():
    """FSDP2's ``FSDPModule`` (what ``fully_shard`` turns a module into), or None."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        try:
            from torch.distributed._composable.fsdp import FSDPModule  # torch 2.4-2.5
        except ImportError:
            return None
    return FSDPModule


def dtensor_cls():
    """``DTensor`` (public from torch 2.5; ``torch.distributed._tensor`` before), or None."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        try:
            from torch.distributed._tensor import DTensor
        except ImportError:
            return None
    return DTensor


def fsdp2_support() -> tuple[bool, str]:
    """(FSDP2 usable here, why not): torch ``fully_shard`` + DCP state-dict helpers, accelerate's ``fsdp_version``."""
    if _torch_version() < FSDP2_MIN_TORCH or fully_shard_fn() is None:
        return False, f"FSDP2 needs torch >= {'.'.join(map(str, FSDP2_MIN_TORCH))} (fully_shard); this is torch {_torch_version()}"
    try:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict  # noqa: F401
    except ImportError:
        return False, "this torch has no torch.distributed.checkpoint.state_dict (needed to save FSDP2 checkpoints)"
    try:
        from accelerate.utils import FullyShardedDataParallelPlugin
    except ImportError:
        return False, "accelerate is not installed"
    if "fsdp_version" not in {f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)}:
        return False, "this accelerate has no FSDP2 (FullyShardedDataParallelPlugin.fsdp_version needs accelerate >= 1.6)"
    return True, "torch fully_shard and accelerate fsdp_version=2 available"


def fsdp_arg_style(args_cls=None) -> str:
    """How TrainingArguments takes FSDP: ``"bool"`` (5.x: ``fsdp=True`` + ``fsdp_config``) or ``"options"`` (4.x string)."""
    if args_cls is None:
        from transformers import TrainingArguments as args_cls
    return "bool" if hasattr(args_cls, "_apply_legacy_fsdp_to_config") else "options"


def fsdp_training_args(fsdp_config: dict, strategy: str, cpu_offload: bool, args_cls=None) -> dict:
    """TrainingArguments overrides that turn on the Trainer's (accelerate's) FSDP with ``fsdp_config``.

    ``fsdp_config`` uses the 5.x key names (``version``, ``reshard_after_forward``, ``cpu_offload``, ...);
    for a 4.x TrainingArguments the strategy and offload also go into the legacy ``fsdp`` option string.
    """
    cfg = dict(fsdp_config)
    if fsdp_arg_style(args_cls) == "bool":
        return {"fsdp": True, "fsdp_config": cfg}
    options = [strategy, "auto_wrap"] + (["offload"] if cpu_offload else [])
    cfg.pop("cpu_offload", None)  # 4.x reads offload from the option string
    return {"fsdp": " ".join(options), "fsdp_config": cfg}


def args_support_parallelism_config(args_cls=None) -> bool:
    """TrainingArguments.parallelism_config (accelerate ParallelismConfig: HSDP under FSDP2) exists in this version."""
    return "parallelism_config" in args_fields(args_cls)


def checkpoints_oldest_first(trainer, run_dir: str) -> list[str]:
    """``run_dir``'s checkpoints in the order the Trainer's rotation deletes them (oldest first, most recent last).

    transformers >= 5 sorts with ``trainer_utils.sort_checkpoints`` (by mtime, falling back to step numbers where
    mtimes are unreliable); 4.x with the Trainer's ``_sorted_checkpoints`` (by step number)."""
    try:
        from transformers.trainer_utils import sort_checkpoints
    except ImportError:
        return trainer._sorted_checkpoints(use_mtime=False, output_dir=run_dir)
    return sort_checkpoints(run_dir, use_mtime=True)


def mark_prepared_for_accelerate(model) -> None:
    """Make ``Accelerator.prepare`` hand ``model`` back untouched (no ``.to()``, no DDP wrap, no second autocast).

    accelerate's own "already prepared" flag; used for a model hf_speedup sharded itself with FSDP2 on CPU,
    where accelerate would otherwise wrap the DTensor model in DistributedDataParallel (and refuse to).
    """
    model._is_accelerate_prepared = True


# --------------------------------------------------------------------------- oneDNN matmul routing
#
# torch >= 2.9 reads ``torch.backends.mkldnn.matmul.fp32_precision`` ("ieee" | "bf16" | "tf32" | "none") on
# every fp32 CPU matmul; "bf16" routes aten::mm through oneDNN's matmul (which may down-convert only where the
# CPU has AMX). Older torch spelled it ``torch._C._set_cpu_allow_bf32`` or lacked it: then None.


def mkldnn_matmul_precision_api():
    """``(get, set)`` callables for oneDNN's fp32 matmul precision, or None where torch lacks the API."""
    getter = getattr(torch._C, "_get_fp32_precision_getter", None)
    setter = getattr(torch._C, "_set_fp32_precision_setter", None)
    if getter is None or setter is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        getter("mkldnn", "matmul")
    except (RuntimeError, TypeError):
        return None
    return (lambda: getter("mkldnn", "matmul")), (lambda value: setter("mkldnn", "matmul", value))
