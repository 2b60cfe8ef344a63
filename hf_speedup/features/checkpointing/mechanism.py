"""How one block is set to checkpoint, and how to read that back from the block itself.

Kept apart from the checkpointing feature (which decides *which* blocks) so that verification reads
the same marks that :func:`enable_block_checkpointing` writes.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from ... import compat


def enable_block_checkpointing(blocks, selected, checkpoint_kwargs: dict, offloader=None) -> str:
    """Checkpoint ``blocks[i]`` for ``i`` in ``selected`` and leave the others alone; returns the mechanism.

    Per-block flags on transformers' ``GradientCheckpointingLayer`` (what ``every_n_layers`` sets in
    transformers 5), so a later in-place ``block.compile()`` traces the checkpoint inside the region.
    Blocks of other classes get their ``forward`` wrapped on the instance, which compiles the same way.
    ``offloader`` (a :class:`~.offload.BlockInputOffloader`) checkpoints with the block inputs in host memory.
    """
    fn = functools.partial(offloader if offloader is not None else checkpoint, **checkpoint_kwargs)
    gc_layer = compat.gradient_checkpointing_layer_cls()
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
    gc_layer = compat.gradient_checkpointing_layer_cls()
    if gc_layer is not None and isinstance(block, gc_layer) and block.gradient_checkpointing:
        return getattr(block, "_gradient_checkpointing_func", None)
    return None


def offloader_of(fn):
    """The offloader a block's checkpoint function keeps its input with (None: the input stays on the device)."""
    from .offload import BlockInputOffloader

    inner = getattr(fn, "func", None)
    return inner if isinstance(inner, BlockInputOffloader) else None


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
