"""SpeedupMixin: ``speedup=`` for any Trainer subclass; SpeedupTrainer: the stock Trainer with it.

The plan's accelerations are applied to the model, the collator and a copy of the TrainingArguments
before the Trainer's own ``__init__`` runs; the training loop stays the Trainer's.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Any

from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from .compat import replace_args
from .credentials import redacted_overrides
from .features import FEATURES, Setup
from .features.fsdp.trainer_hooks import FsdpTrainerMixin
from .gguf import clear_stale_gguf_quantizer
from . import inputs
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
        inputs.check(inputs.launch_problems())  # before TrainingArguments start torch.distributed
        training_args = self.speedup_training_args(bound.arguments.get("args"))
        inputs.check(inputs.output_dir_problems(training_args))  # before any model work
        if isinstance(bound.arguments.get("model"), str):  # a model id (TRL trainers take one): load it first,
            bound.arguments["model"] = _load_model(bound.arguments["model"], config, training_args)  # so the plan sees it
        peft_note = _adopt_peft_config(bound, training_args)  # the trainer's peft_config, applied here: it wins
        user_init = bound.arguments.get("model_init") if bound.arguments.get("model") is None else None
        if user_init is not None:  # the plan needs a model: the first one model_init makes, as the Trainer would
            bound.arguments["model"] = _call_model_init(user_init, None, training_args)
        model = bound.arguments.get("model")
        self.speedup_plan = build_plan(config, probe(), model, training_args)
        # what apply and verify find, beside the frozen plan; ``speedup_status`` joins the two per feature
        self.speedup_outcomes = {feature.NAME: Outcome() for feature in FEATURES}
        self.speedup_status = self.speedup_plan.states(self.speedup_outcomes)
        if peft_note:
            self.speedup_outcomes["lora"].notes.append(peft_note)
        data_plan = self.speedup_plan["data"].settings
        inputs.check(inputs.dataset_problems(
            bound.arguments.get("train_dataset"), training_args, collator=bound.arguments.get("data_collator"),
            processing_class=bound.arguments.get("processing_class"),
            flattens=bool(getattr(data_plan, "padding_free", False)), plan_drop_last=data_plan.loader.get("drop_last")))
        setup = Setup(model=model, args=training_args, data_collator=bound.arguments.get("data_collator"),
                      processing_class=bound.arguments.get("processing_class"),
                      trainer_builds_collator=_builds_own_collator(type(self)),
                      train_dataset=bound.arguments.get("train_dataset"))
        self._speedup_inputs = (training_args, bound.arguments.get("data_collator"))  # for model_init's next models
        overrides: dict = {}
        for feature in FEATURES:
            overrides.update(feature.training_args(self.speedup_plan[feature.NAME], training_args))
        overrides.update(redacted_overrides(training_args))  # hub_token & co. pickle as None (training_args.bin)
        for feature in FEATURES:
            feature.apply(self.speedup_plan[feature.NAME], setup, self.speedup_outcomes[feature.NAME])
        for outcome in self.speedup_outcomes.values():  # an override apply found it cannot honour after all
            for key in outcome.facts.get("withdrawn_args", ()):
                overrides.pop(key, None)
        if setup.model is not None and (note := clear_stale_gguf_quantizer(setup.model)):
            logger.info("hf_speedup: %s", note)  # a dequantized GGUF model trains like any other (LoRA or not)
        bound.arguments.update(model=setup.model, args=replace_args(training_args, overrides))
        if user_init is not None:  # every model model_init makes gets the plan (train() and hyper-parameter search)
            bound.arguments.update(model=None, model_init=self._speedup_model_init(user_init, setup.model))
        if setup.data_collator is not None:
            bound.arguments["data_collator"] = setup.data_collator
        super().__init__(*bound.args, **bound.kwargs)
        self.speedup_report = Report(self.speedup_plan, self.speedup_outcomes)
        # Features that act during training (e.g. ``profile``) bring callbacks; before the collector's, so
        # what they record at train end is in the report it writes.
        for feature in FEATURES:
            make = getattr(feature, "callbacks", None)
            for callback in (make(self.speedup_plan[feature.NAME], self, self.speedup_outcomes[feature.NAME])
                             if make else ()):
                self.add_callback(callback)
        # Measures and reports the run; ``training_step``/``log`` below feed it. Set it to None (and
        # ``remove_callback`` it) to train without reporting.
        self.speedup_callback = SpeedupCallback(self)
        self.add_callback(self.speedup_callback)
        self.verify_speedup()

    def train(self, resume_from_checkpoint=None, *args: Any, **kwargs: Any):
        """Stock ``train()`` inside the features' ``during_train`` contexts (``interrupt``: a handled signal ends
        it with a checkpoint of the current step and :class:`~hf_speedup.features.interrupt.TrainingInterrupted`).

        ``resume_from_checkpoint=True`` is resolved to the last checkpoint here, as the Trainer does, so the
        report can carry its counters over from that checkpoint.
        """
        if resume_from_checkpoint is True and (last := get_last_checkpoint(self.args.output_dir)) is not None:
            resume_from_checkpoint = last  # None: left True, the Trainer raises its own error
        self.speedup_resumed_from = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        with contextlib.ExitStack() as around:  # features that act around the run (``interrupt``: signal handlers)
            for feature in FEATURES:
                if (enter := getattr(feature, "during_train", None)) is not None:
                    name = feature.NAME
                    around.enter_context(enter(self.speedup_plan[name], self, self.speedup_outcomes[name]))
            return super().train(resume_from_checkpoint, *args, **kwargs)

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

    def _speedup_model_init(self, user_init, first_model):
        """``model_init`` with the plan applied to every model it returns; the first one is already set up."""
        pending = [first_model]

        def model_init(trial=None):
            if pending:
                return pending.pop()
            return self._speedup_apply_to(_call_model_init(user_init, trial, self.args, seeded=True))

        return model_init

    def _speedup_apply_to(self, model):
        """Apply the plan to a fresh model from ``model_init`` (outcomes start over; verified at train begin)."""
        user_args, user_collator = self._speedup_inputs
        setup = Setup(model=model, args=user_args, data_collator=user_collator,
                      processing_class=getattr(self, "processing_class", None),
                      trainer_builds_collator=_builds_own_collator(type(self)), train_dataset=self.train_dataset)
        for feature in FEATURES:
            outcome = self.speedup_outcomes[feature.NAME]
            fresh = Outcome()
            for name in vars(fresh):
                setattr(outcome, name, getattr(fresh, name))
            feature.apply(self.speedup_plan[feature.NAME], setup, outcome)
        if setup.data_collator is not None:
            self.data_collator = setup.data_collator
        return setup.model

    def speedup_training_args(self, args):
        """The arguments to plan with: the caller's, or the trainer's default when none were given."""
        return args if args is not None else TrainingArguments(output_dir="trainer_output")


def _next_init_class(cls: type) -> type | None:
    """The class whose ``__init__`` SpeedupMixin's ``super().__init__`` runs."""
    mro = cls.__mro__
    own = set(SpeedupMixin.__mro__)
    start = mro.index(SpeedupMixin) + 1
    return next((c for c in mro[start:] if c not in own and "__init__" in vars(c)), None)


def _builds_own_collator(cls: type) -> bool:
    """A Trainer subclass with its own ``__init__`` (TRL's) may build its own collator when given none;
    only the stock Trainer's default (DataCollatorWithPadding) is known to hf_speedup."""
    nxt = _next_init_class(cls)
    return nxt is not None and nxt is not Trainer


def _call_model_init(model_init, trial, args, seeded: bool = False):
    """A model from ``model_init`` as ``Trainer.call_model_init`` makes it (0 or 1 argument), seeded first as the
    Trainer seeds it, so the model the plan is built on has the weights the stock Trainer's would."""
    from transformers.trainer_utils import enable_full_determinism, number_of_arguments, set_seed

    if not seeded:
        seed = getattr(args, "seed", 42)
        enable_full_determinism(seed) if getattr(args, "full_determinism", False) else set_seed(seed)
    model = model_init() if number_of_arguments(model_init) == 0 else model_init(trial)
    if model is None:
        raise RuntimeError("model_init should not return None.")
    return model


def _load_model(name: str, config, args):
    """A model id or path, loaded the way the plan wants it (with the arguments' ``model_init_kwargs``)."""
    from .loading import load_model

    kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
    logger.info("hf_speedup: loading %s before planning (the trainer was given a model id)", name)
    return load_model(name, speedup=config, **kwargs)


def _adopt_peft_config(bound, args) -> str | None:
    """Wrap the model with the trainer's ``peft_config`` now (seeded as TRL does), so the plan, compile and the
    report see the adapters; the trainer then gets the PeftModel. The user's LoRA wins over a preset's."""
    peft_config = bound.arguments.get("peft_config")
    model = bound.arguments.get("model")
    if peft_config is None or model is None or hasattr(model, "peft_config"):
        return None  # nothing to adopt, or a PeftModel already: the trainer's own check speaks
    from peft import get_peft_model
    from transformers import set_seed

    set_seed(getattr(args, "seed", 42))
    bound.arguments["model"] = get_peft_model(model, peft_config)
    bound.arguments["peft_config"] = None
    targets = getattr(peft_config, "target_modules", None)
    targets = sorted(targets) if isinstance(targets, (set, list, tuple)) else targets
    what = f"{type(peft_config).__name__}(r={getattr(peft_config, 'r', '?')}, target_modules={targets})"
    return f"the trainer's peft_config {what} applied: it wins over the preset's lora section"


class SpeedupTrainer(SpeedupMixin, Trainer):
    """``transformers.Trainer`` plus ``speedup=``; every other argument is the stock Trainer's."""
