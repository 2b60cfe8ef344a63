"""SpeedupMixin: ``speedup=`` for any Trainer subclass; SpeedupTrainer: the stock Trainer with it.

The constructor reads bind -> prepare -> ``Trainer.__init__`` -> attach: the request is resolved and the device
probed once, here; the features are driven through :class:`~hf_speedup.runner.Speedup`, never by name; the
Trainer methods a feature overrides come from the feature (``TRAINER_HOOKS``, the mixin's bases). The training
loop stays the Trainer's.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import typing
from typing import Any

from transformers import Trainer, TrainingArguments

from . import inputs
from .callback_handler import SpeedupCallbackHandler
from .features import Setup
from .hardware import probe
from .model_info import describe_model
from .plan import build_plan, measure
from .stock import buildable_precision
from .presets import resolve
from .report import Report
from .report.collector import SpeedupCallback
from .report.goodput import DATA_WAIT, EVALUATION
from .runner import Speedup, prepare_inputs, trainer_hooks

logger = logging.getLogger("hf_speedup")


class SpeedupMixin(*trainer_hooks()):
    """Gives any ``transformers.Trainer`` subclass ``speedup=`` (a preset name, a SpeedupConfig, a dict or a
    YAML path): ``class MyTrainer(SpeedupMixin, SFTTrainer)``.

    The arguments are bound against the next class's own ``__init__``, so a subclass keeps its parameters
    (``peft_config``, ``formatting_func``, ...); accelerations are then applied and verified on the real objects.
    ``trainer.speedup`` is the run's :class:`~hf_speedup.runner.Speedup` (plan, outcomes, the feature protocol).
    """

    def __init__(self, *args: Any, speedup: Any = "auto", **kwargs: Any):
        # bind: the request, the launch, the arguments and the device, each read once, before any model work
        config = resolve(speedup)
        bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs)
        inputs.check(inputs.launch_problems())  # before TrainingArguments start torch.distributed
        inputs.warn(inputs.launch_warnings())
        given_args = bound.arguments.get("args")
        if given_args is None:  # the config the next trainer would build itself (SFTConfig, DPOConfig, ...)
            given_args = default_training_args(type(self), bound.arguments.get("model"))
        training_args = self.speedup_training_args(given_args)
        inputs.check(inputs.output_dir_problems(training_args))
        caps = probe(training_args)  # the device these arguments train on: the load-time and the training plan's
        # prepare: the model the trainer will train, then the plan for it
        if isinstance(bound.arguments.get("model"), str):  # a model id (TRL trainers take one): load it first,
            # so the plan sees it; TRL's quantization_config is used here, and not again by the trainer
            load_plan = build_plan(config, caps, None, training_args)
            bound.arguments["model"] = _load_model(bound.arguments["model"], load_plan, training_args,
                                                   bound.arguments.pop("quantization_config", None))
        prepared = prepare_inputs(bound.arguments, training_args)  # e.g. the trainer's peft_config applied
        user_init = bound.arguments.get("model_init") if bound.arguments.get("model") is None else None
        if user_init is not None:  # the plan needs a model: the first one model_init makes, as the Trainer would
            bound.arguments["model"] = _call_model_init(user_init, None, training_args)
        model = bound.arguments.get("model")
        info = describe_model(model) if model is not None else None
        caps = measure(config, caps, info)  # what the features time at this model's shapes (cached per machine)
        self.speedup = Speedup(build_plan(config, caps, info, training_args), prepared.outcomes)
        setup = Setup(model=model, args=training_args, data_collator=bound.arguments.get("data_collator"),
                      processing_class=bound.arguments.get("processing_class"),
                      trainer_builds_collator=_builds_own_collator(type(self)),
                      train_dataset=bound.arguments.get("train_dataset"))
        self._speedup_inputs = (training_args, setup.users_collator)  # for model_init's next models
        overrides = {**self.speedup.training_args(setup), **prepared.overrides}  # refuses before any model change
        self.speedup.apply(setup)
        bound.arguments.update(model=setup.model, args=self.speedup.trainer_args(training_args, overrides))
        if user_init is not None:  # every model model_init makes gets the plan (train() and hyper-parameter search)
            bound.arguments.update(model=None, model_init=self._speedup_model_init(user_init, setup.model))
        if setup.data_collator is not None:
            bound.arguments["data_collator"] = setup.data_collator
        super().__init__(*bound.args, **bound.kwargs)
        # attach: the features' last word on the built trainer, their callbacks, the report
        callbacks = self.speedup.attach(self, setup)
        self.speedup_report = Report(self.speedup_plan, self.speedup_outcomes)
        # Our callbacks run after the listed ones but stay off ``callback_handler.callbacks``: the list reads as
        # the stock Trainer's (``all_callbacks(trainer)`` has both). The features' come before the collector's,
        # so what they record at train end is in the report it writes.
        self.callback_handler = SpeedupCallbackHandler.adopt(self.callback_handler)
        for callback in callbacks:
            self.callback_handler.add_own(callback)
        # Measures and reports the run; ``training_step``/``log`` below feed it. Set it to None (and
        # ``remove_callback`` it) to train without reporting.
        self.speedup_callback = SpeedupCallback(self)
        self.callback_handler.add_own(self.speedup_callback)
        self.verify_speedup()

    # the run's plan and outcomes, as the report, the features' Trainer hooks and users read them
    @property
    def speedup_plan(self):
        return self.speedup.plan

    @property
    def speedup_outcomes(self) -> dict:
        return self.speedup.outcomes

    @property
    def speedup_status(self) -> dict:
        return self.speedup.status

    def train(self, resume_from_checkpoint=None, *args: Any, **kwargs: Any):
        """Stock ``train()`` inside the features' ``during_train`` contexts (``interrupt``: a handled signal ends
        it with a checkpoint of the current step and :class:`~hf_speedup.features.interrupt.TrainingInterrupted`)."""
        with self.speedup.during_train(self):
            return super().train(resume_from_checkpoint, *args, **kwargs)

    # ---- report hooks: the stock loop is unchanged, these only observe it --------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Stock step; the report counts the micro-batch's non-padding tokens first (on the device, no sync)."""
        callback = getattr(self, "speedup_callback", None)
        if callback is not None:
            callback.count_batch(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

    def get_batch_samples(self, *args: Any, **kwargs: Any):
        """Stock batch fetch; the report times it as waiting for data (its goodput's ``data`` part)."""
        with self._speedup_phase(DATA_WAIT):
            return super().get_batch_samples(*args, **kwargs)

    def evaluate(self, *args: Any, **kwargs: Any):
        """Stock evaluation; during training the report times it as the wall clock's ``eval`` part."""
        with self._speedup_phase(EVALUATION):
            return super().evaluate(*args, **kwargs)

    def _speedup_phase(self, name: str):
        callback = getattr(self, "speedup_callback", None)
        return callback.phase(name) if callback is not None else contextlib.nullcontext()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Stock log; the ``report_to`` trackers also get the ``hf_speedup/*`` metrics of a training log, while
        ``state.log_history`` and every other callback get the stock logs."""
        callback = getattr(self, "speedup_callback", None)
        if callback is not None:
            ours = callback.metrics_for_log(logs)
            if ours and isinstance(self.callback_handler, SpeedupCallbackHandler):
                self.callback_handler.tracker_logs = ours
        super().log(logs, start_time)

    def verify_speedup(self) -> None:
        """Re-check every feature on the live objects (model, optimizer, args)."""
        self.speedup.verify(self)

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
        self.speedup.reset()
        self.speedup.apply(setup)
        if setup.data_collator is not None:
            self.data_collator = setup.data_collator
        if getattr(setup.model, "config", None) is not None:  # what Trainer.__init__ does for its first model: a
            setup.model.config.use_cache = self.args.use_cache  # cache in training forwards recompiles every block
        return setup.model

    def speedup_training_args(self, args):
        """The arguments to plan with: the caller's, or :func:`default_training_args` when none were given
        (a subclass may convert them, as :class:`~hf_speedup.trl_support.SpeedupSFTTrainer` does)."""
        return args


def _next_init_class(cls: type) -> type | None:
    """The class whose ``__init__`` SpeedupMixin's ``super().__init__`` runs."""
    mro = cls.__mro__
    own = set(SpeedupMixin.__mro__)
    start = mro.index(SpeedupMixin) + 1
    return next((c for c in mro[start:] if c not in own and "__init__" in vars(c)), None)


def default_training_args(cls: type, model: Any) -> TrainingArguments:
    """The arguments the next trainer builds when given ``args=None``, so planning sees the same defaults: a TRL
    trainer builds the config class its ``__init__`` annotates, named after the model (``SFTConfig("Qwen3-SFT")``,
    ``DPOConfig("Qwen3-DPO")``), whose defaults differ from TrainingArguments' (SFT: lr 2e-5, bf16, gradient
    checkpointing) and whose fields it reads (DPO: ``model_init_kwargs``); else ``TrainingArguments``."""
    args_cls = _annotated_args_class(cls) or TrainingArguments
    output_dir = "trainer_output"
    if args_cls is not TrainingArguments and args_cls.__name__.endswith("Config"):
        name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
        output_dir = f"{str(name or '').split('/')[-1]}-{args_cls.__name__.removesuffix('Config')}"
    return args_cls(output_dir=output_dir, **buildable_precision())


def _annotated_args_class(cls: type) -> type | None:
    """The TrainingArguments subclass that the first ``__init__`` after SpeedupMixin's annotates for ``args``
    (``SFTConfig | TrainingArguments | None`` -> SFTConfig); None where no ``__init__`` annotates one."""
    own = set(SpeedupMixin.__mro__)
    for klass in cls.__mro__[cls.__mro__.index(SpeedupMixin) + 1:]:
        if klass in own or "__init__" not in vars(klass):
            continue
        param = inspect.signature(vars(klass)["__init__"]).parameters.get("args")
        annotation = param.annotation if param is not None else inspect.Parameter.empty
        if isinstance(annotation, str):  # ``from __future__ import annotations`` in the trainer's module
            try:
                annotation = eval(annotation, vars(inspect.getmodule(klass)))  # noqa: S307 - as inspect's eval_str
            except Exception:
                continue
        for candidate in typing.get_args(annotation) or (annotation,):
            if isinstance(candidate, type) and issubclass(candidate, TrainingArguments):
                return candidate
    return None


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


def _load_model(name: str, plan, args, quantization_config=None):
    """A model id or path, loaded the way ``plan`` (made without the model, for the trainer's device) wants it, with what TRL's trainers load it with: the arguments'
    ``model_init_kwargs``, the trainer's ``quantization_config`` (QLoRA from a model id) and ``trust_remote_code``;
    under DDP/DeepSpeed no ``device_map`` of the caller's ("auto" fails there; the plan places a quantized model
    on the local rank)."""
    from .loading import load_planned

    kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
    if quantization_config is not None:
        if "quantization_config" in kwargs:
            raise ValueError(
                "quantization_config is set both as a trainer argument and in args.model_init_kwargs "
                f"({kwargs['quantization_config']!r}); allowed: one of the two; fix: drop "
                "model_init_kwargs['quantization_config'] and keep the trainer argument")
        kwargs["quantization_config"] = quantization_config
    if getattr(getattr(args, "distributed_state", None), "distributed_type", None) in ("MULTI_GPU", "DEEPSPEED"):
        kwargs.pop("device_map", None)
    if hasattr(args, "trust_remote_code"):
        kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    logger.info("hf_speedup: loading %s before planning (the trainer was given a model id)", name)
    return load_planned(name, plan, **kwargs)


class SpeedupTrainer(SpeedupMixin, Trainer):
    """``transformers.Trainer`` plus ``speedup=``; every other argument is the stock Trainer's."""
