"""TRL: ``SpeedupSFTTrainer`` = :class:`~hf_speedup.trainer.SpeedupMixin` + ``trl.SFTTrainer``.

What the mixin does for any TRL trainer (``class MyTrainer(SpeedupMixin, DPOTrainer)`` too):

- the trainer keeps its own collator, data preparation and packing: given no collator, hf_speedup builds
  none (a subclass with its own ``__init__`` makes its own), and padding-free rows are asked of TRL itself
  (``SFTConfig.padding_free``) where TRL accepts them;
- ``peft_config=`` is applied before planning, so the plan, compile and the report see the adapters; the
  user's LoRA wins over a preset's ``lora`` section and shows as engaged. A template TRL would clone first
  (``chat_template_path``) is cloned first, its new tokens trainable as TRL makes them; the frozen ``ref`` copy
  DPO-family trainers add to a PeftModel handed to them is removed (stock TRL given ``peft_config`` has none);
- a model id is loaded before planning as TRL loads it (``model_init_kwargs``, the trainer's
  ``quantization_config``, ``trust_remote_code``); given no ``args``, the trainer's own config class is built
  as TRL builds it (``SFTConfig("<model>-SFT")``, ``DPOConfig("<model>-DPO")``, ...);
- presets map onto ``SFTConfig`` fields where TRL has them: ``padding_free``, ``packing``,
  ``pad_to_multiple_of`` (data), ``use_liger_kernel`` (liger) and ``activation_offloading`` (memory, on
  CUDA), each through the feature's ``training_args`` where the arguments have the field.

Importing this module imports TRL; ``hf_speedup.SpeedupSFTTrainer`` does so on first use.
"""

from __future__ import annotations

from typing import Any

from trl import SFTConfig, SFTTrainer

from .features.explicit_args import EXPLICIT_ARGS_ATTR
from .trainer import SpeedupMixin


class SpeedupSFTTrainer(SpeedupMixin, SFTTrainer):
    """``trl.SFTTrainer`` plus ``speedup=``; every other argument is SFTTrainer's (``peft_config``,
    ``formatting_func``, a model id, ...)."""

    def speedup_training_args(self, args: Any):
        """An ``SFTConfig`` to plan with: a TrainingArguments converted as SFTTrainer itself converts it, so that
        the preset's SFTConfig fields can be set (given none, the mixin builds TRL's default SFTConfig)."""
        if args is not None and not isinstance(args, SFTConfig):
            values = args.to_dict()
            values["hub_token"] = args.hub_token  # to_dict hides it
            converted = SFTConfig(**values)
            if hasattr(args, EXPLICIT_ARGS_ATTR):  # what training_arguments() recorded as the caller's own choices
                setattr(converted, EXPLICIT_ARGS_ATTR, getattr(args, EXPLICIT_ARGS_ATTR))
            return converted
        return args

