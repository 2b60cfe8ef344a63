"""Presets for people who keep the stock Trainer: what TrainingArguments can carry of a plan."""

from __future__ import annotations

import logging
from typing import Any

from .compat import replace_args
from .features import FEATURES
from .plan import build_plan

logger = logging.getLogger("hf_speedup")

# Features applied to the model itself: TrainingArguments cannot carry them unless the feature says how.
MODEL_LEVEL = {"compile", "lora", "checkpointing", "fsdp"}


def training_arguments(preset: Any = "auto", **kwargs):
    """A stock ``TrainingArguments`` carrying what TrainingArguments can express of a preset on this machine.

    Features it cannot express (regional compile, LoRA, selective checkpointing, ...) are logged, not
    dropped silently; use SpeedupTrainer for those. The caller's own keyword arguments win.
    """
    from transformers import TrainingArguments

    kwargs.setdefault("output_dir", "trainer_output")
    args = TrainingArguments(**kwargs)
    plan = build_plan(preset, args=args)
    overrides: dict = {}
    for feature in FEATURES:
        decision = plan[feature.NAME]
        wanted = feature.training_args(decision, args)
        # a feature that SpeedupTrainer applies to the model may still have a stock-Trainer equivalent
        if hasattr(feature, "stock_trainer_args"):
            wanted = {**wanted, **feature.stock_trainer_args(decision, args)}
        overrides.update({k: v for k, v in wanted.items() if k not in kwargs})
        if feature.NAME in MODEL_LEVEL and decision.active and not wanted:
            logger.warning("hf_speedup: %s=%r changes the model itself and cannot be expressed in "
                           "TrainingArguments; use SpeedupTrainer for it", feature.NAME, decision.applied)
    return replace_args(args, overrides)
