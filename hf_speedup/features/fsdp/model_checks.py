"""The checks that need the model (``apply``); the sharding itself waits for the Trainer (``trainer_hooks``)."""

from __future__ import annotations

import logging

import torch

from ...config import SpeedupConfigError
from ...dtypes import long_name
from ...plan_types import Decision, Outcome

logger = logging.getLogger("hf_speedup")


def apply(decision: Decision, setup, outcome: Outcome) -> None:
    """Refuse what FSDP cannot shard, warn about what it shards badly.

    hf_speedup backend: ``SpeedupTrainer`` (``trainer_hooks.FsdpTrainerMixin``) calls ``fully_shard`` right
    after the Accelerator exists, so LoRA adapters, activation checkpointing and compiled regions are in
    place first.
    """
    if not decision.active:
        return
    model = setup.model
    if model is None:
        return
    packed = [n for n, p in model.named_parameters() if type(p).__name__ == "Params4bit" and p.dtype == torch.uint8]
    if packed:
        want = long_name(decision.settings.qlora_quant_storage or torch.bfloat16)
        raise SpeedupConfigError([
            f"fsdp with a 4-bit base: {len(packed)} weight(s) (e.g. {packed[0]}) are stored as uint8, which FSDP "
            f"leaves unsharded; fix: load with BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=torch."
            f"{want}) (the dtype of the other parameters)"
        ])
    if decision.settings.backend == "hf_speedup":
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        if len(dtypes) > 1 and decision.settings.mixed_precision is None:
            logger.warning("hf_speedup fsdp: parameters have several dtypes (%s); FSDP2 all-gathers each unit in "
                           "one dtype", ", ".join(sorted(str(d) for d in dtypes)))
