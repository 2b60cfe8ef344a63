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
