"""The feature protocol in one place: every trainer class and the stock-Trainer helpers drive the features the
same way, through :class:`Speedup` (and :func:`prepare_inputs` before there is a plan), and never by name.

The phases, each a loop over ``FEATURES`` calling the hook a feature defines (see ``features/__init__.py``):

    prepare_inputs   before planning: the trainer's own inputs made ready (a peft_config applied, ...)
    problems         what the user's inputs cannot do under the plan (with ``training_args``: one error)
    training_args    TrainingArguments overrides; an explicit value of the user's wins or the run refuses
    apply            the model and the collator changed before ``Trainer.__init__``
    TRAINER_HOOKS    the Trainer methods a feature overrides (bases of ``SpeedupMixin``)
    attach           once, right after ``Trainer.__init__``
    callbacks        what acts during training
    during_train     contexts ``train()`` runs inside
    verify           what engaged, read off the live objects
    reset            outcomes start over (``model_init``'s next model)
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator

from .compat import replace_args
from .credentials import redacted_overrides
from .features import FEATURES, Setup
from .features.explicit_args import overridden_choices
from .gguf import clear_stale_gguf_quantizer
from .plan_types import Outcome, Plan

logger = logging.getLogger("hf_speedup")


def trainer_hooks() -> tuple[type, ...]:
    """The features' Trainer-method mixins, in ``FEATURES`` order (the bases ``SpeedupMixin`` is made of)."""
    return tuple(hooks for feature in FEATURES if (hooks := getattr(feature, "TRAINER_HOOKS", None)) is not None)


@dataclass
class Prepared:
    """What the features did to a trainer's inputs before planning: their outcomes so far and the
    TrainingArguments overrides that follow from it."""

    outcomes: dict[str, Outcome]
    overrides: dict = field(default_factory=dict)


def prepare_inputs(inputs: dict, args: Any) -> Prepared:
    """Let each feature ready the trainer's bound arguments ``inputs`` (changed in place) before the plan is made:
    the plan must see the model the trainer will train (with the trainer's ``peft_config`` applied, say)."""
    outcomes = {feature.NAME: Outcome() for feature in FEATURES}
    overrides: dict = {}
    for feature in FEATURES:
        if (prepare := getattr(feature, "prepare", None)) is not None:
            overrides.update(prepare(inputs, args, outcomes[feature.NAME]) or {})
    return Prepared(outcomes, overrides)


class Speedup:
    """One run's features: the frozen plan, what each feature found (``outcomes``), and the protocol."""

    def __init__(self, plan: Plan, outcomes: dict[str, Outcome] | None = None):
        self.plan = plan
        self.outcomes = {feature.NAME: Outcome() for feature in FEATURES}
        self.outcomes.update(outcomes or {})

    def _each(self, hook: str) -> Iterator[tuple[Any, Any, Outcome]]:
        """(the feature's hook, its decision, its outcome) for every feature that defines ``hook``."""
        for feature in FEATURES:
            if (fn := getattr(feature, hook, None)) is not None:
                yield fn, self.plan[feature.NAME], self.outcomes[feature.NAME]

    @property
    def status(self) -> dict:
        """Every feature as it stands now: its decision joined with its outcome, in report order."""
        return self.plan.states(self.outcomes)

    # -- before Trainer.__init__ ----------------------------------------------------------------------
    def training_args(self, setup: Setup) -> dict:
        """The plan's TrainingArguments overrides for ``setup.args``. An explicit value of the user's that a
        feature would change, and what the user's inputs (training data, collator) cannot do under the plan,
        stop the run here: every problem in one error, before any model change."""
        args = setup.args
        overrides: dict = {}
        problems: list[str] = []
        for check, decision, _ in self._each("problems"):
            problems += check(decision, setup)
        for feature in FEATURES:
            wanted = feature.training_args(self.plan[feature.NAME], args)
            problems += overridden_choices(args, wanted, feature.NAME, self.plan.config.name)
            overrides.update(wanted)
        _raise_if(problems)
        overrides.update(redacted_overrides(args))  # hub_token & co. pickle as None (training_args.bin)
        return overrides

    def apply(self, setup: Setup) -> None:
        """Every feature's ``apply`` on ``setup`` (model, collator), in ``FEATURES`` order."""
        for apply, decision, outcome in self._each("apply"):
            apply(decision, setup, outcome)
        if setup.model is not None and (note := clear_stale_gguf_quantizer(setup.model)):
            logger.info("hf_speedup: %s", note)  # a dequantized GGUF model trains like any other (LoRA or not)

    def trainer_args(self, args: Any, overrides: dict) -> Any:
        """The arguments the Trainer is built with: ``args`` with ``overrides``, less those an ``apply`` found it
        could not honour after all (``withdrawn_args``)."""
        withdrawn = {key for outcome in self.outcomes.values() for key in outcome.facts.get("withdrawn_args", ())}
        return replace_args(args, {k: v for k, v in overrides.items() if k not in withdrawn})

    # -- after Trainer.__init__ -----------------------------------------------------------------------
    def attach(self, trainer: Any, setup: Setup) -> list:
        """Once, right after ``Trainer.__init__`` built ``trainer`` from ``setup``: the features' ``attach`` hooks,
        then their callbacks (returned, for the trainer to register before its report collector)."""
        for attach, decision, outcome in self._each("attach"):
            attach(decision, trainer, outcome, setup)
        return [callback for make, decision, outcome in self._each("callbacks")
                for callback in make(decision, trainer, outcome)]

    @contextlib.contextmanager
    def during_train(self, trainer: Any) -> Iterator[None]:
        """Every feature's ``during_train`` context around one ``train()`` (``interrupt``: its signal handlers)."""
        with contextlib.ExitStack() as around:
            for enter, decision, outcome in self._each("during_train"):
                around.enter_context(enter(decision, trainer, outcome))
            yield

    def verify(self, trainer: Any) -> None:
        """Every feature checked on the live objects; a verifier that fails says why and never stops training."""
        for verify, decision, outcome in self._each("verify"):
            try:
                outcome.engaged, outcome.engaged_reason = verify(decision, trainer, outcome)
            except Exception as exc:
                outcome.engaged, outcome.engaged_reason = False, f"verification failed: {exc!r}"

    def reset(self) -> None:
        """Outcomes start over, in place (the report and the trainer hold these objects): a fresh model from
        ``model_init`` is applied to and verified anew."""
        for outcome in self.outcomes.values():
            fresh = Outcome()
            for name in vars(fresh):
                setattr(outcome, name, getattr(fresh, name))

    # -- the stock Trainer --------------------------------------------------------------------------
    def stock_overrides(self, args: Any, explicit: frozenset, args_cls: str) -> dict:
        """What a stock ``TrainingArguments`` subclass ``args_cls`` can carry of the plan, the caller's own values
        kept (logged); what it cannot carry is logged, never dropped silently."""
        name = self.plan.config.name
        overrides: dict = {}
        for feature in FEATURES:
            decision = self.plan[feature.NAME]
            wanted = feature.training_args(decision, args)
            if (stock := getattr(feature, "stock_trainer_args", None)) is not None:  # a stock equivalent
                wanted = {**wanted, **stock(decision, args)}
            overrides.update({k: v for k, v in wanted.items() if k not in explicit})
            for k, v in wanted.items():
                if k in explicit and getattr(args, k, None) != v:
                    logger.info("hf_speedup: %s: kept your %s=%r over the %r of preset %r (an explicit argument "
                                "wins)", args_cls, k, getattr(args, k, None), v, name)
            for warning in _stock_cannot_carry(feature, decision, self.plan, bool(wanted), args_cls):
                logger.warning("hf_speedup: preset %r: %s", name, warning)
            for note in _quiet_stock_notes(feature, decision, args_cls):
                logger.info("hf_speedup: preset %r: %s", name, note)
        return overrides


def _stock_cannot_carry(feature, decision, plan: Plan, carried: bool, args_cls: str) -> list[str]:
    """Why the stock Trainer goes without (part of) this feature, by where it acts (``APPLIES_TO``)."""
    out = []
    applies_to = getattr(feature, "APPLIES_TO", "args")
    changes_model = getattr(feature, "changes_model", None)
    if applies_to == "model" and not carried and (changes_model(decision, plan) if changes_model else decision.active):
        out.append(f"{feature.NAME}={decision.applied if decision.active else decision.requested!r} changes the model "
                   f"itself and cannot be expressed in {args_cls}: dropped here; use SpeedupTrainer (or SpeedupMixin) "
                   "for it")
    if applies_to == "train" and decision.active and getattr(feature, "STOCK_TRAINER_WARNS", True):
        out.append(_train_only(feature, decision, args_cls))
    if (extra := getattr(feature, "stock_trainer_warnings", None)) is not None:
        out += extra(decision, args_cls)
    return out


def _quiet_stock_notes(feature, decision, args_cls: str) -> list[str]:
    """A safety net the stock Trainer lacks, where the feature says that is only worth a note."""
    if getattr(feature, "APPLIES_TO", "args") == "train" and decision.active and \
            not getattr(feature, "STOCK_TRAINER_WARNS", True):
        return [_train_only(feature, decision, args_cls)]
    return []


def _train_only(feature, decision, args_cls: str) -> str:
    return (f"{feature.NAME}={decision.applied!r} needs SpeedupTrainer's train() and cannot be expressed in {args_cls}: "
            f"dropped here ({getattr(feature, 'STOCK_TRAINER', 'the stock Trainer goes without it')})")


def _raise_if(problems: list[str]) -> None:
    if problems:
        from .config import SpeedupConfigError

        raise SpeedupConfigError(problems)
