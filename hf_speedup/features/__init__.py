"""One module per acceleration, each with the same small surface; its name is also its config section
and its report key (``features/compile.py`` <-> ``SpeedupConfig.compile`` <-> ``report["plan"]["compile"]``).

Every feature module defines:

- ``NAME``: that one name;
- ``Settings``: a frozen dataclass, the typed parameters ``decide`` chose and ``apply`` uses;
- ``decide(ctx: PlanContext) -> Decision``: pure, reads config, capabilities, model info and the
  decisions of the features before it in ``FEATURES``; the Decision is frozen from then on;
- ``training_args(decision, args) -> dict``: TrainingArguments overrides (``{}`` when off or when
  TrainingArguments cannot express it); used by SpeedupTrainer and by ``training_arguments()``;
- ``apply(decision, setup: Setup, outcome: Outcome) -> None``: changes ``setup.model``/``setup.data_collator``;
  a no-op when the decision is off; what it had to do differently is recorded in ``outcome``;
- ``verify(decision, trainer, outcome) -> (engaged, reason)``: inspects the real objects after setup
  (facts worth reporting go to ``outcome.facts``);
- optionally ``callbacks(decision, trainer, outcome) -> list[TrainerCallback]``: for features that act
  during training (``profile``, ``interrupt``); SpeedupTrainer registers them before its report collector;
- optionally ``during_train(decision, trainer, outcome)``: a context manager SpeedupTrainer's ``train()`` runs
  inside (``interrupt``: signal handlers for the run);
- optionally ``APPLIES_TO``: ``"args"`` (the default: TrainingArguments carry it), ``"model"`` (changes the
  model: SpeedupTrainer/SpeedupMixin only) or ``"train"`` (acts around ``train()``); what
  ``training_arguments()`` tells a stock-Trainer user it cannot carry.

The order below is the order of decisions and of application (LoRA wraps before blocks are
checkpointed and compiled; FSDP decides before checkpointing so it is done only once; the chunked loss
reads the compile and FSDP decisions; profile comes last so it labels the loss function finally in place;
data decides before attention and compile: padding-free rows choose the kernel and a dynamic sequence dimension;
liger before loss: Liger's fused cross-entropy, where on, keeps the chunked loss out).

Adding an acceleration: a module here with that surface, its section in ``config.py``, and its name in
``FEATURES``; the trainer, the report and the CLI pick it up from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import (attention, checkpointing, compile, crash_safe, data, fsdp, interrupt, liger, lora, loss, memory,
               optimizer, precision, profile)

FEATURES = (precision, lora, fsdp, checkpointing, data, attention, compile, optimizer, memory, liger, loss, profile,
            interrupt, crash_safe)


@dataclass
class Setup:
    """The objects features change before ``Trainer.__init__`` runs."""

    model: Any
    args: Any  # the user's TrainingArguments, read-only: changes go through ``training_args``
    data_collator: Any = None
    processing_class: Any = None
    trainer_builds_collator: bool = False  # a Trainer subclass (TRL's) makes its own collator when given none
    train_dataset: Any = None  # read-only: what the data feature checks its loader settings against
