"""SpeedupMixin: ``speedup=`` for any Trainer subclass; SpeedupTrainer: the stock Trainer with it.

The plan's accelerations are applied to the model, the collator and a copy of the TrainingArguments
before the Trainer's own ``__init__`` runs; the training loop stays the Trainer's.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

from transformers import Trainer, TrainingArguments

from .compat import replace_args
from .features import FEATURES, Setup
from .features.fsdp.trainer_hooks import FsdpTrainerMixin
from .gguf import clear_stale_gguf_quantizer
from .hardware import probe
from .plan import build_plan
from .plan_types import Outcome
from .presets import resolve
from .report import Report
from .report.collector import SpeedupCallback

logger = logging.getLogger("hf_speedup")


class SpeedupMixin(FsdpTrainerMixin):
    """Gives any ``transformers.Trainer`` subclass ``speedup=`` (a preset name, a SpeedupConfig, a dict or a
    YAML path): ``class MyTrainer(SpeedupMixin, SFTTrainer)``.

    The arguments are bound against the next class's own ``__init__``, so a subclass keeps its parameters
    (``peft_config``, ``formatting_func``, ...); accelerations are then applied and verified on the real objects.
    """

    def __init__(self, *args: Any, speedup: Any = "auto", **kwargs: Any):
        config = resolve(speedup)  # bad input fails here, before any model work
        bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs)
        model = bound.arguments.get("model")
        training_args = bound.arguments.get("args") or TrainingArguments(output_dir="trainer_output")
        self.speedup_plan = build_plan(config, probe(), model, training_args)
        # what apply and verify find, beside the frozen plan; ``speedup_status`` joins the two per feature
        self.speedup_outcomes = {feature.NAME: Outcome() for feature in FEATURES}
        self.speedup_status = self.speedup_plan.states(self.speedup_outcomes)
        setup = Setup(model=model, args=training_args, data_collator=bound.arguments.get("data_collator"),
                      processing_class=bound.arguments.get("processing_class"))
        overrides: dict = {}
        for feature in FEATURES:
            overrides.update(feature.training_args(self.speedup_plan[feature.NAME], training_args))
        for feature in FEATURES:
            feature.apply(self.speedup_plan[feature.NAME], setup, self.speedup_outcomes[feature.NAME])
        if setup.model is not None and (note := clear_stale_gguf_quantizer(setup.model)):
            logger.info("hf_speedup: %s", note)  # a dequantized GGUF model trains like any other (LoRA or not)
        bound.arguments.update(model=setup.model, args=replace_args(training_args, overrides))
        if setup.data_collator is not None:
            bound.arguments["data_collator"] = setup.data_collator
        super().__init__(*bound.args, **bound.kwargs)
        self.speedup_report = Report(self.speedup_plan, self.speedup_outcomes)
        # Measures and reports the run; ``training_step``/``log`` below feed it. Set it to None (and
        # ``remove_callback`` it) to train without reporting.
        self.speedup_callback = SpeedupCallback(self)
        self.add_callback(self.speedup_callback)
        self.verify_speedup()

    # ---- report hooks: the stock loop is unchanged, these only observe it --------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Stock step; the report counts the micro-batch's non-padding tokens first (on the device, no sync)."""
        callback = getattr(self, "speedup_callback", None)
        if callback is not None:
            callback.count_batch(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Stock log; training logs gain ``hf_speedup/*`` metrics, so every ``report_to`` tracker gets them."""
        callback = getattr(self, "speedup_callback", None)
        if callback is not None:
            logs = callback.augment_logs(logs)
        super().log(logs, start_time)

    def verify_speedup(self) -> None:
        """Re-check every feature on the live objects (model, optimizer, args)."""
        for feature in FEATURES:
            outcome = self.speedup_outcomes[feature.NAME]
            try:
                outcome.engaged, outcome.engaged_reason = feature.verify(self.speedup_plan[feature.NAME], self, outcome)
            except Exception as exc:  # a verifier must never break training; say why instead
                outcome.engaged, outcome.engaged_reason = False, f"verification failed: {exc!r}"


class SpeedupTrainer(SpeedupMixin, Trainer):
    """``transformers.Trainer`` plus ``speedup=``; every other argument is the stock Trainer's."""
