"""Find the parts of a model every feature agrees on: the repeated decoder block (the unit compile,
checkpointing and FSDP share), the final norm, and the transformers model under its wrappers."""

from __future__ import annotations

from collections import Counter

from torch import nn


def _pretrained_roots(model: nn.Module) -> list[nn.Module]:
    """Modules carrying ``_no_split_modules`` (the HF model itself, or the base model under peft)."""
    return [m for m in model.modules() if getattr(m, "_no_split_modules", None)]


def block_class_names(model: nn.Module) -> list[str]:
    """Names of the block classes, from HF's ``_no_split_modules`` or else the homogeneous ModuleList.

    ``_no_split_modules`` also lists modules that must merely stay on one device (BERT's ``BertEmbeddings``):
    only classes whose instances sit in a ``ModuleList`` (the repeated stack) count as blocks. The names come
    in forward order (``_no_split_modules`` is a set in recent transformers: its order changes run to run).
    """
    declared: set[str] = set()
    for root in _pretrained_roots(model):
        declared.update(root._no_split_modules or [])
    present: list[str] = []  # declared classes, in forward order
    stacked: set[str] = set()
    for m in model.modules():
        name = type(m).__name__
        if name in declared and name not in present:
            present.append(name)
        if isinstance(m, nn.ModuleList):
            stacked.update(type(c).__name__ for c in m)
    names = [n for n in present if n in stacked] or present
    if names:
        return names
    lst = _largest_homogeneous_list(model)
    return [type(lst[0]).__name__] if lst is not None else []


def _largest_homogeneous_list(model: nn.Module) -> nn.ModuleList | None:
    best = None
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) >= 2:
            kinds = Counter(type(c) for c in m)
            if len(kinds) == 1 and (best is None or len(m) > len(best)):
                best = m
    return best


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The block instances in forward order, outermost only (a block inside a block is not listed)."""
    names = set(block_class_names(model))
    if not names:
        return []
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for m in model.modules():
        if id(m) in inside:
            continue
        if type(m).__name__ in names:
            blocks.append(m)
            inside.update(id(c) for c in m.modules())
    return blocks


def block_layouts(blocks: list[nn.Module]) -> list[tuple[int, nn.Module]]:
    """(count, first such block) per distinct block structure (class, parameter names and shapes, adapters left
    out), in order: mixtures of experts may begin with dense blocks (DeepSeek-V3's first_k_dense_replace,
    Qwen2-MoE's mlp_only_layers) or alternate (Llama 4), so one block does not describe them all."""
    groups: dict = {}
    for b in blocks:
        key = (type(b), tuple((n, tuple(p.shape)) for n, p in b.named_parameters() if "lora_" not in n))
        groups.setdefault(key, [0, b])[0] += 1
    return [(count, b) for count, b in groups.values()]


def find_block_class(model: nn.Module) -> type | None:
    """The class of the (first) repeated block, for wrap policies that want a type."""
    blocks = find_blocks(model)
    return type(blocks[0]) if blocks else None


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model under peft (``get_base_model``) and DDP/accelerate (``.module``) wrappers."""
    for _ in range(8):
        if hasattr(model, "get_base_model") and model.get_base_model() is not model:
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module) and not hasattr(model, "lm_head"):
            model = model.module
        else:
            break
    return model


def find_final_norm(model: nn.Module) -> nn.Module | None:
    """The norm after the last block: the decoder's ``norm`` where transformers names one (``get_decoder``),
    else the last norm among the direct children of the inner model (``transformer.ln_f``)."""
    base = unwrap_model(model)
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else None
    if isinstance(getattr(decoder, "norm", None), nn.Module):
        return decoder.norm
    prefix = getattr(base, "base_model_prefix", "")
    inner = getattr(base, prefix, None) if prefix else None
    inner = inner if isinstance(inner, nn.Module) else base
    found = None
    for _, child in inner.named_children():
        if "norm" in type(child).__name__.lower():
            found = child
    return found
