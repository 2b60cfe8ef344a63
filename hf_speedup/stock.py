"""Presets for people who keep the stock Trainer (or TRL's SFTTrainer): what their arguments can carry of a plan."""

from __future__ import annotations

import logging
from typing import Any

from .compat import replace_args, set_tf32
from .features.explicit_args import EXPLICIT_ARGS_ATTR
from .hardware import probe
from .inputs import check, launch_problems
from .plan import build_plan
from .presets import resolve
from .runner import Speedup

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
        raise ImportError("sft_config needs TRL: pip install 'hf_speedup[trl]' (trl==1.16.0, the release tested)") from exc
    return _stock_args(SFTConfig, preset, kwargs)


def _stock_args(args_cls, preset: Any, kwargs: dict):
    config = resolve(preset)  # a bad preset fails before anything else
    check(launch_problems())  # before the arguments start torch.distributed
    explicit = frozenset(kwargs)  # the caller's choices, even those equal to a field's default
    kwargs.setdefault("output_dir", "trainer_output")
    if not {"bf16", "fp16"} & explicit:  # a config class's own bf16 default (TRL's) is not the user's choice
        kwargs.update(buildable_precision())
    args = args_cls(**kwargs)
    plan = build_plan(config, probe(args), None, args)
    out = replace_args(args, Speedup(plan).stock_overrides(args, explicit, args_cls.__name__))
    if getattr(out, "tf32", None) is not None and plan.caps.tf32:
        set_tf32(out.tf32)  # as the arguments just set it, but readable by inductor (see compat.set_tf32)
    setattr(out, EXPLICIT_ARGS_ATTR, explicit)  # SpeedupTrainer keeps these over a preset's loader choices
    return out


def buildable_precision() -> dict:
    """``bf16=False`` where no bf16 GPU is present: TRL's configs default to ``bf16=True``, which TrainingArguments
    refuses there (a stock ``SFTConfig()`` raises on such a machine); the plan's precision feature then picks the dtype (``baseline``:
    fp32)."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    if is_torch_bf16_gpu_available() or is_torch_xla_available():
        return {}
    logger.info("hf_speedup: no bf16 GPU here: the %s is built with bf16=False (the plan picks the dtype)", "config")
    return {"bf16": False}
