"""One module (or one package, its helpers inside) per acceleration, each with the same small surface; its name is
also its config section and its report key (``features/compile/`` <-> ``SpeedupConfig.compile`` <->
``report["plan"]["compile"]``).

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
- optionally ``prepare(inputs: dict, args, outcome) -> dict``: before planning, readies the trainer's bound
  arguments in place (``lora``: the trainer's ``peft_config`` applied, so the plan sees the adapters); returns
  TrainingArguments overrides;
- optionally ``problems(decision, setup) -> list[str]``: what the user's inputs cannot do under the decision
  (``data``: the training set against the collator), raised with every other problem in one error before apply;
- optionally ``TRAINER_HOOKS``: a mixin class of the Trainer methods the feature overrides (``fsdp``: the
  accelerator and sharded checkpoints; ``data``: the loaders; ``crash_safe``: staged saves); a base of
  ``SpeedupMixin``, pass-throughs where the feature is off;
- optionally ``attach(decision, trainer, outcome, setup)``: once, right after ``Trainer.__init__``;
- optionally ``callbacks(decision, trainer, outcome) -> list[TrainerCallback]``: for features that act
  during training (``profile``, ``interrupt``); SpeedupTrainer registers them before its report collector;
- optionally ``during_train(decision, trainer, outcome)``: a context manager SpeedupTrainer's ``train()`` runs
  inside (``interrupt``: signal handlers for the run);
- optionally ``APPLIES_TO``: ``"args"`` (the default: TrainingArguments carry it), ``"model"`` (changes the
  model: SpeedupTrainer/SpeedupMixin only) or ``"train"`` (acts around ``train()``); what
  ``training_arguments()`` tells a stock-Trainer user it cannot carry (with ``changes_model(decision, plan)``,
  ``stock_trainer_args``, ``stock_trainer_warnings``, ``STOCK_TRAINER``/``STOCK_TRAINER_WARNS`` where the
  feature says more).

``runner.Speedup`` drives these hooks for every trainer class and the stock-Trainer helpers; no trainer names a
feature.

The order below is the order of decisions and of application (sequence_parallel after the engines it needs and
before data and attention, which keep rows unpacked and pick a kernel it takes; DeepSpeed first: a user's DeepSpeed config is read
before anything adapts to it; LoRA wraps before blocks are
checkpointed and compiled; FSDP decides before checkpointing so it is done only once; the chunked loss
reads the compile and FSDP decisions; profile comes last so it labels the loss function finally in place;
data decides before attention and compile: padding-free rows choose the kernel and a dynamic sequence dimension;
experts after precision (the dtype its timing ran in) and before compile and memory (which kernel the MoE blocks
run, what the estimate models);
liger before loss: Liger's fused cross-entropy, where on, keeps the chunked loss out; tiled_mlp after compile: it
stays off beside compiled blocks unless asked for, and wraps the MLPs after compile set the blocks up).

Adding an acceleration: a module (or a package, its helpers inside) here with that surface, its section in
``config.py``, and its name in ``FEATURES``; the trainer, the report and the CLI pick it up from there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import (attention, checkpointing, compile, crash_safe, data, deepspeed, experts, fsdp, interrupt, liger, lora,
               loss, memory, optimizer, precision, profile, sequence_parallel, tiled_mlp)

FEATURES = (deepspeed, precision, lora, fsdp, sequence_parallel, checkpointing, data, attention, experts, compile,
            tiled_mlp, optimizer, memory, liger, loss, profile, interrupt, crash_safe)


@dataclass
class Setup:
    """The objects features change before ``Trainer.__init__`` runs."""

    model: Any
    args: Any  # the user's TrainingArguments, read-only: changes go through ``training_args``
    data_collator: Any = None
    processing_class: Any = None
    trainer_builds_collator: bool = False  # a Trainer subclass (TRL's) makes its own collator when given none
    train_dataset: Any = None  # read-only: what the data feature checks its loader settings against
    users_collator: Any = field(init=False, default=None)  # read-only: the collator the user passed

    def __post_init__(self) -> None:
        self.users_collator = self.data_collator
