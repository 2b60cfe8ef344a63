"""One module per acceleration, each with the same small surface.

Every feature module defines:

- ``NAME``: its key in the plan and the report;
- ``decide(ctx: PlanContext) -> Decision``: pure, reads config, capabilities, model info and the
  decisions of the features before it in ``FEATURES``;
- ``training_args(decision, args) -> dict``: TrainingArguments overrides (``{}`` when off or when
  TrainingArguments cannot express it); used by SpeedupTrainer and by ``training_arguments()``;
- ``apply(decision, setup: Setup) -> None``: changes ``setup.model``/``setup.data_collator``; a no-op
  when the decision is off;
- ``verify(decision, trainer) -> (engaged, reason)``: inspects the real objects after setup.

The order below is the order of decisions and of application (LoRA wraps before blocks are
checkpointed and compiled; FSDP decides before checkpointing so it is done only once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import checkpointing, data, fsdp, lora, memory, optim, precision, regional_compile

FEATURES = (precision, lora, fsdp, checkpointing, regional_compile, optim, memory, data)


@dataclass
class Setup:
    """The objects features change before ``Trainer.__init__`` runs."""

    model: Any
    args: Any  # the user's TrainingArguments, read-only: changes go to ``arg_overrides``
    data_collator: Any = None
    processing_class: Any = None
