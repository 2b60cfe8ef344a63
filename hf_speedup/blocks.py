"""Find the repeated decoder block of a model: the one unit that compile, checkpointing and FSDP share."""

from __future__ import annotations

from collections import Counter

from torch import nn


def _pretrained_roots(model: nn.Module) -> list[nn.Module]:
    """Modules carrying ``_no_split_modules`` (the HF model itself, or the base model under peft)."""
    return [m for m in model.modules() if getattr(m, "_no_split_modules", None)]


def block_class_names(model: nn.Module) -> list[str]:
    """Names of the block classes, from HF's ``_no_split_modules`` or else the homogeneous ModuleList."""
    names: list[str] = []
    for root in _pretrained_roots(model):
        for n in root._no_split_modules or []:
            if n not in names:
                names.append(n)
    present = {type(m).__name__ for m in model.modules()}
    names = [n for n in names if n in present]
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


def find_block_class(model: nn.Module) -> type | None:
    """The class of the (first) repeated block, for wrap policies that want a type."""
    blocks = find_blocks(model)
    return type(blocks[0]) if blocks else None
