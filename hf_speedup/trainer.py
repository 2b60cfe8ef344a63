"""SpeedupMixin: ``speedup=`` for any Trainer subclass; SpeedupTrainer: the stock Trainer with it.

The plan's accelerations are applied to the model, the collator and a copy of the TrainingArguments
before the Trainer's own ``__init__`` runs; the training loop stays the Trainer's.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
import typing
from typing import Any

from transformers import Trainer, TrainingArguments

from .callback_handler import SpeedupCallbackHandler
from .compat import replace_args
from .credentials import redacted_overrides
from .features import FEATURES, Setup
from .features import data as data_feature
from .features import lora as lora_feature
from .features.explicit_args import overridden_choices
from .features.fsdp.trainer_hooks import FsdpTrainerMixin
from .features.crash_safe import CrashSafeMixin, resolve_resume
from .gguf import clear_stale_gguf_quantizer
from . import inputs
from .hardware import probe
from .plan import build_plan
from .plan_types import Outcome
from .presets import resolve
from .report import Report
from .report.collector import SpeedupCallback

logger = logging.getLogger("hf_speedup")


class SpeedupMixin(FsdpTrainerMixin, CrashSafeMixin):
    """Gives any ``transformers.Trainer`` subclass ``speedup=`` (a preset name, a SpeedupConfig, a dict or a
    YAML path): ``class MyTrainer(SpeedupMixin, SFTTrainer)``.

    The arguments are bound against the next class's own ``__init__``, so a subclass keeps its parameters
    (``peft_config``, ``formatting_func``, ...); accelerations are then applied and verified on the real objects.
    """

    def __init__(self, *args: Any, speedup: Any = "auto", **kwargs: Any):
        config = resolve(speedup)  # bad input fails here, before any model work
        bound = inspect.signature(super().__init__).bind_partial(*args, **kwargs)
        inputs.check(inputs.launch_problems())  # before TrainingArguments start torch.distributed
        inputs.warn(inputs.launch_warnings())
        given_args = bound.arguments.get("args")
        if given_args is None:  # the config the next trainer would build itself (SFTConfig, DPOConfig, ...)
            given_args = default_training_args(type(self), bound.arguments.get("model"))
        training_args = self.speedup_training_args(given_args)
        inputs.check(inputs.output_dir_problems(training_args))  # before any model work
        if isinstance(bound.arguments.get("model"), str):  # a model id (TRL trainers take one): load it first,
            # so the plan sees it; TRL's quantization_config is used here, and not again by the trainer
            bound.arguments["model"] = _load_model(bound.arguments["model"], config, training_args,
                                                   bound.arguments.pop("quantization_config", None))
        reused = lora_feature.wrapper_of(bound.arguments.get("model"))  # a model an earlier trainer adapted
        adopted = reused is not bound.arguments.get("model")
        if adopted:
            bound.arguments["model"] = reused
        wrapped_here = not hasattr(bound.arguments.get("model"), "peft_config")  # adapters made here are fresh
        # the trainer's peft_config, applied here: it wins (and its chat template clone, done here before it)
        peft_note, peft_overrides = _adopt_peft_config(bound, training_args)
        user_init = bound.arguments.get("model_init") if bound.arguments.get("model") is None else None
        if user_init is not None:  # the plan needs a model: the first one model_init makes, as the Trainer would
            bound.arguments["model"] = _call_model_init(user_init, None, training_args)
        model = bound.arguments.get("model")
        self.speedup_plan = build_plan(config, probe(training_args), model, training_args)
        # what apply and verify find, beside the frozen plan; ``speedup_status`` joins the two per feature
        self.speedup_outcomes = {feature.NAME: Outcome() for feature in FEATURES}
        self.speedup_status = self.speedup_plan.states(self.speedup_outcomes)
        if peft_note:
            self.speedup_outcomes["lora"].notes.append(peft_note)
        if adopted:
            self.speedup_outcomes["lora"].notes.append(
                "the model was adapted in place by an earlier trainer (peft adds its layers to the model it wraps): "
                "trained through that trainer's PeftModel, adapters as they are")
        data_plan = self.speedup_plan["data"].settings
        inputs.check(inputs.dataset_problems(
            bound.arguments.get("train_dataset"), training_args, collator=bound.arguments.get("data_collator"),
            processing_class=bound.arguments.get("processing_class"),
            flattens=bool(data_plan.padding_free or data_plan.rows_flattened)))
        users_collator = bound.arguments.get("data_collator")
        setup = Setup(model=model, args=training_args, data_collator=users_collator,
                      processing_class=bound.arguments.get("processing_class"),
                      trainer_builds_collator=_builds_own_collator(type(self)),
                      train_dataset=bound.arguments.get("train_dataset"))
        self._speedup_inputs = (training_args, bound.arguments.get("data_collator"))  # for model_init's next models
        overrides: dict = {}
        problems: list[str] = []
        for feature in FEATURES:
            wanted = feature.training_args(self.speedup_plan[feature.NAME], training_args)
            problems += overridden_choices(training_args, wanted, feature.NAME, config.name)
            overrides.update(wanted)
        inputs.check(problems)  # your explicit TrainingArguments win, or the run stops here, before any model change
        overrides.update(redacted_overrides(training_args))  # hub_token & co. pickle as None (training_args.bin)
        overrides.update(peft_overrides)
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
        adapters_before = set(getattr(setup.model, "peft_config", None) or ())
        super().__init__(*bound.args, **bound.kwargs)
        # evaluation and prediction batch as the user's setup would: every row, as the stock Trainer shows it
        self.speedup_eval_collator = data_feature.evaluation_collator(self, users_collator, setup.data_collator,
                                                                      training_args)
        if wrapped_here and (note := _drop_reference_adapter(self.model, adapters_before)):
            self.speedup_outcomes["lora"].notes.append(note)
        self.speedup_report = Report(self.speedup_plan, self.speedup_outcomes)
        # Our callbacks run after the listed ones but stay off ``callback_handler.callbacks``: the list reads as
        # the stock Trainer's (``all_callbacks(trainer)`` has both).
        self.callback_handler = SpeedupCallbackHandler.adopt(self.callback_handler)
        # Features that act during training (e.g. ``profile``) bring callbacks; before the collector's, so
        # what they record at train end is in the report it writes.
        for feature in FEATURES:
            make = getattr(feature, "callbacks", None)
            for callback in (make(self.speedup_plan[feature.NAME], self, self.speedup_outcomes[feature.NAME])
                             if make else ()):
                self.callback_handler.add_own(callback)
        # Measures and reports the run; ``training_step``/``log`` below feed it. Set it to None (and
        # ``remove_callback`` it) to train without reporting.
        self.speedup_callback = SpeedupCallback(self)
        self.callback_handler.add_own(self.speedup_callback)
        self.verify_speedup()

    def train(self, resume_from_checkpoint=None, *args: Any, **kwargs: Any):
        """Stock ``train()`` inside the features' ``during_train`` contexts (``interrupt``: a handled signal ends
        it with a checkpoint of the current step and :class:`~hf_speedup.features.interrupt.TrainingInterrupted`).

        ``resume_from_checkpoint=True`` is resolved to the newest complete checkpoint here (incomplete ones set
        aside: ``crash_safe``), so the report can carry its counters over from that checkpoint.
        """
        resume_from_checkpoint = resolve_resume(self, resume_from_checkpoint)  # True when none: the Trainer's error
        self.speedup_resumed_from = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        with contextlib.ExitStack() as around:  # features that act around the run (``interrupt``: signal handlers)
            for feature in FEATURES:
                if (enter := getattr(feature, "during_train", None)) is not None:
                    name = feature.NAME
                    around.enter_context(enter(self.speedup_plan[name], self, self.speedup_outcomes[name]))
            return super().train(resume_from_checkpoint, *args, **kwargs)

    def get_eval_dataloader(self, eval_dataset=None):
        """Stock evaluation loader, batched by the user's collator (see ``data.evaluation_collator``)."""
        with data_feature.evaluation_loader(self):
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        """Stock prediction loader, batched by the user's collator (see ``data.evaluation_collator``)."""
        with data_feature.evaluation_loader(self):
            return super().get_test_dataloader(test_dataset)

    def get_train_dataloader(self):
        """Stock training loader; where the plan drops the last partial batch (static-shape compile), this loader
        alone does: ``args.dataloader_drop_last`` stays the user's, so evaluation and prediction see every row."""
        with data_feature.training_loader(self):
            return super().get_train_dataloader()

    # ---- report hooks: the stock loop is unchanged, these only observe it --------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """Stock step; the report counts the micro-batch's non-padding tokens first (on the device, no sync)."""
        callback = getattr(self, "speedup_callback", None)
        if callback is not None:
            callback.count_batch(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

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
    return args_cls(output_dir=output_dir, **_buildable_precision())


def _buildable_precision() -> dict:
    """``bf16=False`` where no bf16 GPU is present: TRL's configs default to ``bf16=True``, which TrainingArguments
    refuses there (stock TRL given no args raises); the plan's precision feature then picks the dtype (``baseline``:
    fp32)."""
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    if is_torch_bf16_gpu_available() or is_torch_xla_available():
        return {}
    logger.info("hf_speedup: no args given and no bf16 GPU here: the default config is built with bf16=False")
    return {"bf16": False}


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


def _load_model(name: str, config, args, quantization_config=None):
    """A model id or path, loaded the way the plan wants it, with what TRL's trainers load it with: the arguments'
    ``model_init_kwargs``, the trainer's ``quantization_config`` (QLoRA from a model id) and ``trust_remote_code``;
    under DDP/DeepSpeed no ``device_map`` of the caller's ("auto" fails there; the plan places a quantized model
    on the local rank)."""
    from .loading import load_model

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
    return load_model(name, speedup=config, **kwargs)


def _adopt_peft_config(bound, args) -> tuple[str | None, dict]:
    """Wrap the model with the trainer's ``peft_config`` now (seeded as TRL does), so the plan, compile and the
    report see the adapters; the trainer then gets the PeftModel. The user's LoRA wins over a preset's.

    Returns (a note for the report, argument overrides for the trainer). A chat template that TRL would clone
    (``chat_template_path``) is cloned here first, with TRL's handling of the tokens it adds, because TRL clones
    before it applies ``peft_config``: the overrides then tell the trainer not to clone it a second time."""
    peft_config = bound.arguments.get("peft_config")
    model = bound.arguments.get("model")
    if peft_config is None or model is None or hasattr(model, "peft_config"):
        return None, {}  # nothing to adopt, or a PeftModel already: the trainer's own check speaks
    from peft import get_peft_model
    from transformers import set_seed

    set_seed(getattr(args, "seed", 42))
    overrides: dict = {}
    if _clones_chat_template(args):
        added_tokens = _clone_chat_template(bound, args)
        peft_config = _with_added_tokens(peft_config, added_tokens)
        overrides["chat_template_path"] = None
    bound.arguments["model"] = get_peft_model(bound.arguments["model"], peft_config)
    bound.arguments["peft_config"] = None
    targets = getattr(peft_config, "target_modules", None)
    targets = sorted(targets) if isinstance(targets, (set, list, tuple)) else targets
    what = f"{type(peft_config).__name__}(r={getattr(peft_config, 'r', '?')}, target_modules={targets})"
    note = f"the trainer's peft_config {what} applied: it wins over the preset's lora section"
    if overrides:
        note += (f"; the chat template of {args.chat_template_path} cloned first (as TRL does), its new tokens "
                 "trainable (trainable_token_indices, modules_to_save=['lm_head'])")
    return note, overrides


def _clones_chat_template(args) -> bool:
    """TRL (SFT, reward) clones the template of a tokenizer named by ``chat_template_path``, adding its tokens;
    a ``.jinja``/``.j2`` file only sets the template."""
    path = getattr(args, "chat_template_path", None)
    return path is not None and not (os.path.isfile(path) and str(path).endswith((".jinja", ".j2")))


def _clone_chat_template(bound, args) -> list[int]:
    """TRL's ``clone_chat_template`` on the bound model and processing class (loaded from the model as TRL loads
    it when none was given); returns the ids of the tokens it added."""
    from trl.chat_template_utils import clone_chat_template

    model, processing_class = bound.arguments["model"], bound.arguments.get("processing_class")
    if processing_class is None:
        from transformers import AutoProcessor

        revision = (getattr(args, "model_init_kwargs", None) or {}).get("revision")
        processing_class = AutoProcessor.from_pretrained(getattr(model.config, "_name_or_path", ""), revision=revision,
                                                         trust_remote_code=getattr(args, "trust_remote_code", False))
    model, processing_class, added_tokens = clone_chat_template(model, processing_class, args.chat_template_path)
    bound.arguments.update(model=model, processing_class=processing_class)
    return list(added_tokens)


def _with_added_tokens(peft_config, added_tokens: list[int]):
    """A copy of ``peft_config`` that trains the added tokens' embeddings and the ``lm_head``, as TRL makes it
    (TRL edits the caller's config in place; this leaves it as given)."""
    if not added_tokens:
        return peft_config
    peft_config = copy.deepcopy(peft_config)
    indices = peft_config.trainable_token_indices
    if indices is None:
        peft_config.trainable_token_indices = {"embed_tokens": list(added_tokens)}
    elif isinstance(indices, dict):
        indices.setdefault("embed_tokens", []).extend(added_tokens)
    else:  # a list of ids for the input embedding
        peft_config.trainable_token_indices = [*indices, *added_tokens]
    if "lm_head" not in (peft_config.modules_to_save or []):
        logger.warning("hf_speedup: cloning the chat template added tokens but 'lm_head' is not in the peft_config's "
                       "modules_to_save; added it (as TRL does), so the model can learn to generate them")
        peft_config.modules_to_save = [*(peft_config.modules_to_save or []), "lm_head"]
    return peft_config


def _drop_reference_adapter(model, adapters_before: set) -> str | None:
    """Delete the frozen ``ref`` adapter a TRL trainer (DPO, KTO, GRPO, RLOO) added to the PeftModel hf_speedup
    made: it copies a pretrained adapter for the reference model, but ours are fresh (a no-op, like the base
    model), and stock TRL given ``peft_config`` adds none and scores the reference with the adapters disabled,
    which it does again once ``ref`` is gone (it checks ``"ref" in model.peft_config`` on every step)."""
    model = getattr(model, "_orig_mod", model)
    added = set(getattr(model, "peft_config", None) or ()) - adapters_before
    if "ref" not in added or not hasattr(model, "delete_adapter"):
        return None
    model.delete_adapter("ref")
    return ("removed the frozen 'ref' adapter the trainer copied from hf_speedup's fresh one: the reference "
            "model is the base model with adapters disabled, as with the trainer's own peft_config")


class SpeedupTrainer(SpeedupMixin, Trainer):
    """``transformers.Trainer`` plus ``speedup=``; every other argument is the stock Trainer's."""
