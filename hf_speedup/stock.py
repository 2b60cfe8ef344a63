"""Presets for people who keep the stock Trainer (or TRL's SFTTrainer): what their arguments can carry of a plan."""

from __future__ import annotations

import logging
from typing import Any

from .compat import replace_args, set_tf32
from .features import FEATURES
from .features.data import EXPLICIT_ARGS_ATTR
from .inputs import check, launch_problems
from .plan import build_plan

logger = logging.getLogger("hf_speedup")



def training_arguments(preset: Any = "auto", **kwargs):
    """A stock ``TrainingArguments`` carrying what TrainingArguments can express of a preset on this machine.

    Features it cannot express (regional compile, LoRA, selective checkpointing, ...) are logged, not
    dropped silently; use SpeedupTrainer for those. The caller's own keyword arguments win.
    """
    from transformers import TrainingArguments

    return _stock_args(TrainingArguments, preset, kwargs)


def sft_config(preset: Any = "auto", **kwargs):
    """A stock TRL ``SFTConfig`` carrying what it can express of a preset on this machine: the same as
    :func:`training_arguments`, plus TRL's own fields (``padding_free`` where TRL accepts it, ``packing``,
    ``pad_to_multiple_of``). The model-level features are logged; ``SpeedupSFTTrainer`` applies them."""
    try:
        from trl import SFTConfig
    except ImportError as exc:  # pragma: no cover - exercised where trl is missing
        raise ImportError("sft_config needs TRL: pip install 'hf_speedup[trl]' (or pip install trl)") from exc
    return _stock_args(SFTConfig, preset, kwargs)


def _stock_args(args_cls, preset: Any, kwargs: dict):
    check(launch_problems())  # before the arguments start torch.distributed
    explicit = frozenset(kwargs)  # the caller's choices, even those equal to a field's default
    kwargs.setdefault("output_dir", "trainer_output")
    args = args_cls(**kwargs)
    plan = build_plan(preset, args=args)
    name = plan.config.name
    overrides: dict = {}
    for feature in FEATURES:
        decision = plan[feature.NAME]
        wanted = feature.training_args(decision, args)
        # a feature that SpeedupTrainer applies to the model may still have a stock-Trainer equivalent
        if hasattr(feature, "stock_trainer_args"):
            wanted = {**wanted, **feature.stock_trainer_args(decision, args)}
        overrides.update({k: v for k, v in wanted.items() if k not in kwargs})
        for k, v in wanted.items():
            if k in kwargs and kwargs[k] != v:
                logger.info("hf_speedup: %s: kept your %s=%r over the %r of preset %r (an explicit argument "
                            "wins)", args_cls.__name__, k, kwargs[k], v, name)
        applies_to = getattr(feature, "APPLIES_TO", "args")  # see the feature contract in features/__init__.py
        if applies_to == "model" and _changes_model(feature.NAME, decision, plan) and not wanted:
            logger.warning("hf_speedup: preset %r: %s=%r changes the model itself and cannot be expressed in %s: "
                           "dropped here; use SpeedupTrainer (or SpeedupMixin) for it", name, feature.NAME,
                           decision.applied if decision.active else decision.requested, args_cls.__name__)
        if applies_to == "train" and decision.active:  # a safety net the stock Trainer lacks is only noted
            log = logger.warning if getattr(feature, "STOCK_TRAINER_WARNS", True) else logger.info
            log("hf_speedup: preset %r: %s=%r needs SpeedupTrainer's train() and cannot be expressed in %s: dropped "
                "here (%s)", name, feature.NAME, decision.applied, args_cls.__name__,
                getattr(feature, "STOCK_TRAINER", "the stock Trainer goes without it"))
    if plan["data"].settings.train_drop_last:
        logger.warning("hf_speedup: preset %r: data.drop_last (the last partial training batch) cannot be expressed in "
                       "%s, whose dataloader_drop_last drops evaluation and prediction rows too: dropped here (it "
                       "only spares a recompile of SpeedupTrainer's regional compile)", name, args_cls.__name__)
    if plan["data"].settings.padding_free_via == "collator":
        logger.warning("hf_speedup: preset %r: data.padding_free (padding-free rows) replaces the collator and cannot "
                       "be expressed in %s: the stock Trainer keeps padding; use SpeedupTrainer (or, with TRL, "
                       "sft_config, which sets SFTConfig.padding_free)", name, args_cls.__name__)
    out = replace_args(args, overrides)
    if getattr(out, "tf32", None) is not None and plan.caps.tf32:
        set_tf32(out.tf32)  # as the arguments just set it, but readable by inductor (see compat.set_tf32)
    setattr(out, EXPLICIT_ARGS_ATTR, explicit)  # SpeedupTrainer keeps these over a preset's loader choices
    return out


def _changes_model(name: str, decision, plan) -> bool:
    """Whether SpeedupTrainer would change the model for this feature. Planned without a model, regional
    compile reads "no block found"; what it would do for a model with blocks is what the config asks."""
    if decision.active:
        return True
    if name == "compile":
        asked = plan.config.compile.enabled
        return asked is True or (asked == "auto" and plan.caps.is_cuda)
    return False
