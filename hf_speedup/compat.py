"""Version differences of transformers / accelerate / torch, in one place."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any


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
    values.update(overrides)
    return type(args)(**values)


def enable_model_checkpointing(model, kwargs: dict) -> None:
    """``activation_checkpointing_enable`` (new) or ``gradient_checkpointing_enable`` (old)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def trainer_init_params() -> list[str]:
    from transformers import Trainer

    return list(inspect.signature(Trainer.__init__).parameters)[1:]


def fsdp2_available() -> bool:
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
    except ImportError:
        return False
    return True


def unwrap_optimizer(opt: Any) -> Any:
    """accelerate wraps the optimizer; the real one is ``.optimizer`` (possibly nested)."""
    seen = 0
    while hasattr(opt, "optimizer") and seen < 5:
        opt = opt.optimizer
        seen += 1
    return opt


# --------------------------------------------------------------------------- precision / allocator
# (appended for features/precision.py and features/memory.py)


def tf32_matmul_enabled() -> bool:
    """Whether fp32 CUDA matmuls may use TF32, read without tripping torch's legacy/new-API mixing check.

    torch >= 2.9 has ``fp32_precision`` ("tf32" | "ieee" | "none" = inherit); transformers sets the new
    API, and reading the legacy ``allow_tf32`` after that raises, so the new API is read first.
    """
    import torch

    matmul = torch.backends.cuda.matmul
    try:
        prec = getattr(matmul, "fp32_precision", None)
    except RuntimeError:
        prec = None
    if prec not in (None, "none"):
        return prec == "tf32"
    glob = getattr(torch.backends, "fp32_precision", None)
    if glob not in (None, "none"):
        return glob == "tf32"
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:
        return False


def get_allocator_settings() -> str | None:
    """The caching-allocator settings string in force (torch >= 2.9), or None where torch cannot say."""
    import torch

    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is None:
        return None
    try:
        return getter()
    except RuntimeError:
        return None


def set_allocator_settings(conf: str) -> bool:
    """Change caching-allocator settings at run time (applies to segments allocated from now on)."""
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:  # torch < 2.9: the CUDA-only (now deprecated) spelling
        setter = getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None)
    if setter is None:
        return False
    setter(conf)
    return True


# --------------------------------------------------------------------------- FSDP1 / FSDP2
# (appended for features/fsdp.py and sharding.py)
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
    import torch

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
    import dataclasses as _dc

    if "fsdp_version" not in {f.name for f in _dc.fields(FullyShardedDataParallelPlugin)}:
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


def mark_prepared_for_accelerate(model) -> None:
    """Make ``Accelerator.prepare`` hand ``model`` back untouched (no ``.to()``, no DDP wrap, no second autocast).

    accelerate's own "already prepared" flag; used for a model hf_speedup sharded itself with FSDP2 on CPU,
    where accelerate would otherwise wrap the DTensor model in DistributedDataParallel (and refuse to).
    """
    model._is_accelerate_prepared = True


# --------------------------------------------------------------------------- checkpointing / GGUF
# (appended for features/checkpointing.py, features/lora.py and loading.py)


def _gc_layer_class():
    """transformers' ``GradientCheckpointingLayer`` (>= 4.52), or None on older versions."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return None
    return GradientCheckpointingLayer


def enable_block_checkpointing(blocks, selected, checkpoint_kwargs: dict) -> str:
    """Checkpoint ``blocks[i]`` for ``i`` in ``selected`` and leave the others alone; returns the mechanism.

    Per-block flags on transformers' ``GradientCheckpointingLayer`` (what ``every_n_layers`` sets in
    transformers 5), so a later in-place ``block.compile()`` traces the checkpoint inside the region.
    Blocks of other classes get their ``forward`` wrapped on the instance, which compiles the same way.
    """
    import functools

    from torch.utils.checkpoint import checkpoint

    fn = functools.partial(checkpoint, **checkpoint_kwargs)
    gc_layer = _gc_layer_class()
    selected = set(selected)
    mechanism = "GradientCheckpointingLayer flags"
    for i, block in enumerate(blocks):
        if gc_layer is not None and isinstance(block, gc_layer):
            block._gradient_checkpointing_func = fn
            block.gradient_checkpointing = i in selected
        elif i in selected:
            _wrap_forward(block, fn)
            mechanism = "forward wrapper"
    return mechanism


def _wrap_forward(block, fn) -> None:
    """Instance-level checkpointed ``forward`` (idempotent) for blocks transformers does not manage."""
    import functools

    import torch

    if getattr(block.forward, "_hf_speedup_checkpointed", False):
        return
    inner = block.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if block.training and torch.is_grad_enabled():
            return fn(functools.partial(inner, **kwargs), *args)
        return inner(*args, **kwargs)

    forward._hf_speedup_checkpointed = True
    forward._hf_speedup_checkpoint_fn = fn
    block.forward = forward


def block_checkpoint_fn(block):
    """The checkpoint function a block will use when training, or None where it is not checkpointed."""
    if getattr(block.forward, "_hf_speedup_checkpointed", False):
        return block.forward._hf_speedup_checkpoint_fn
    gc_layer = _gc_layer_class()
    if gc_layer is not None and isinstance(block, gc_layer) and block.gradient_checkpointing:
        return getattr(block, "_gradient_checkpointing_func", None)
    return None


def is_non_reentrant(fn) -> bool | None:
    """``use_reentrant`` of a ``functools.partial(checkpoint, ...)``; None when it cannot be read."""
    keywords = getattr(fn, "keywords", None)
    if keywords is None:
        return None
    return keywords.get("use_reentrant", True) is False


def disable_kv_cache(model) -> int:
    """``use_cache=False`` on every config in the model (a cache is useless and wasteful under checkpointing)."""
    changed = 0
    seen: set[int] = set()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        for c in (cfg, cfg.get_text_config() if hasattr(cfg, "get_text_config") else None):
            if c is not None and getattr(c, "use_cache", False):
                c.use_cache = False
                changed += 1
    return changed


def _gguf_quantizer(model):
    q = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(q, "quantization_config", None), "quant_method", None)
    return q if str(getattr(method, "value", method)).lower() == "gguf" else None


def clear_stale_gguf_quantizer(model) -> str | None:
    """Make a GGUF-loaded model trainable when its weights really are plain floats; returns what was done.

    transformers dequantizes GGUF tensors into ordinary ``nn.Linear`` weights, yet (5.x, legacy
    architectures such as llama) keeps a ``GgufHfQuantizer`` on the model whose ``is_trainable`` is
    False, so ``Trainer.__init__`` refuses it even with LoRA attached. The flag is stale: we drop it
    with the quantizer's own ``remove_quantization_config`` (what transformers does itself for
    ``GgufConfig(dequantize=True)``), only after checking that no packed GGUF layer and no integer
    weight is left. Raises where weights are still packed: those cannot be trained.
    """
    import torch

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    q = _gguf_quantizer(base)
    if q is None:
        return None
    packed = [n for n, m in base.named_modules() if "gguf" in type(m).__name__.lower() or "ggml" in type(m).__name__.lower()]
    packed += [n for n, p in base.named_parameters() if not p.is_floating_point()]
    if packed or getattr(q, "packed_modules", None):
        raise ValueError(
            f"this GGUF model keeps {len(packed) or len(q.packed_modules)} weight(s) packed in GGUF blocks "
            f"(e.g. {(packed or list(q.packed_modules))[:3]}), which cannot be trained; fix: load it dequantized with "
            "hf_speedup.load_model(path_to.gguf) or from_pretrained(..., gguf_file=..., "
            "quantization_config=GgufConfig(dequantize=True))"
        )
    if hasattr(q, "remove_quantization_config"):
        q.remove_quantization_config(base)
    else:  # older transformers: the same three attributes by hand
        for attr in ("hf_quantizer", "quantization_method"):
            if hasattr(base, attr):
                delattr(base, attr)
        if hasattr(base.config, "quantization_config"):
            del base.config.quantization_config
        base.is_quantized = False
    for m in base.modules():  # transformers marks every sub-model's config as quantized too
        cfg = getattr(m, "config", None)
        if getattr(cfg, "_is_quantized", False):
            cfg._is_quantized = False
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in base.parameters() if isinstance(p, torch.Tensor)})
    return f"GGUF weights were dequantized to {'/'.join(dtypes)} at load; the stale GGUF quantizer flag was cleared"


def gguf_dequantize_config():
    """``GgufConfig(dequantize=True)`` where transformers has it (5.x); None where GGUF is always dequantized."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return None
    return GgufConfig(dequantize=True)


# --------------------------------------------------------------------------- oneDNN matmul routing
# (appended for features/regional_compile.py)
#
# torch >= 2.9 reads ``torch.backends.mkldnn.matmul.fp32_precision`` ("ieee" | "bf16" | "tf32" | "none") on
# every fp32 CPU matmul; "bf16" routes aten::mm through oneDNN's matmul (which may down-convert only where the
# CPU has AMX). Older torch spelled it ``torch._C._set_cpu_allow_bf32`` or lacked it: then None.


def mkldnn_matmul_precision_api():
    """``(get, set)`` callables for oneDNN's fp32 matmul precision, or None where torch lacks the API."""
    import torch

    getter = getattr(torch._C, "_get_fp32_precision_getter", None)
    setter = getattr(torch._C, "_set_fp32_precision_setter", None)
    if getter is None or setter is None or not torch.backends.mkldnn.is_available():
        return None
    try:
        getter("mkldnn", "matmul")
    except (RuntimeError, TypeError):
        return None
    return (lambda: getter("mkldnn", "matmul")), (lambda value: setter("mkldnn", "matmul", value))
