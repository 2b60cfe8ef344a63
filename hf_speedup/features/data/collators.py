"""The collators batches go through: padded to a multiple of N, flattened into padding-free rows, or the trainer's.

Also who flattens rows (our collator, or a trainer's own ``padding_free``/``packing`` arguments), the
``use_cache`` guard for rows the trainer's arguments flatten, and the collator evaluation and prediction
batch with.
"""

from __future__ import annotations

import contextlib
import copy
import logging

from ... import compat
from ...plan_types import Decision, Outcome
from . import padding_free as pf

logger = logging.getLogger("hf_speedup")


def _args_have(args, name: str) -> bool:
    import dataclasses

    return args is not None and dataclasses.is_dataclass(args) and any(
        f.name == name for f in dataclasses.fields(args))


def honours_padding_free(args) -> bool:
    """Whether the trainer these arguments are for flattens batches when asked (``padding_free=True``): TRL's
    ``SFTConfig`` (and subclasses). ``DPOConfig`` has the field too, but TRL's DPOTrainer switches it off
    with a warning, so asking there would flatten nothing while the plan counted on it."""
    return compat.is_trl_sft_config(args)


def args_flatten(args, via: str | None, packing: bool | None) -> str | None:
    """Why the trainer's final arguments make flattened rows, None where they do not: TRL's ``packing``
    (several examples per row: fewer rows than examples) or a ``padding_free`` its trainer honours, whether
    the plan sets them (``via``, ``packing``) or the user's arguments already do."""
    if args is None:
        return None
    name = type(args).__name__
    if _args_have(args, "packing") and (packing if packing is not None else getattr(args, "packing", False)):
        return f"{name}.packing=True"
    if honours_padding_free(args) and (via == "trainer" or getattr(args, "padding_free", False)):
        return f"{name}.padding_free=True"
    return None


def _is_default_padding_target(processing_class) -> bool:
    """Mirror of the Trainer's own choice of ``DataCollatorWithPadding`` as the default collator."""
    from transformers import PreTrainedTokenizerBase
    from transformers.feature_extraction_sequence_utils import SequenceFeatureExtractor

    return isinstance(processing_class, (PreTrainedTokenizerBase, SequenceFeatureExtractor))


def padded_collator(collator, processing_class, multiple: int):
    """(collator to use or None to keep, note): a copy padding to ``multiple``; None plus why when it can't."""
    if collator is None:
        if processing_class is not None and _is_default_padding_target(processing_class):
            from transformers import DataCollatorWithPadding

            return DataCollatorWithPadding(processing_class, pad_to_multiple_of=multiple), (
                "built DataCollatorWithPadding(pad_to_multiple_of) - the Trainer's own default for this tokenizer")
        return None, ("no collator to pad: the Trainer's default_data_collator only stacks rows; pass a padding "
                      "collator (e.g. DataCollatorForLanguageModeling) or a tokenizer as processing_class")
    if not hasattr(collator, "pad_to_multiple_of"):
        return None, f"{type(collator).__name__} has no pad_to_multiple_of; pad in your collator instead"
    current = collator.pad_to_multiple_of
    if current and current % multiple == 0:
        return collator, f"{type(collator).__name__} already pads to a multiple of {current}"
    new = copy.copy(collator)
    new.pad_to_multiple_of = multiple
    note = f"{type(collator).__name__}.pad_to_multiple_of={multiple}"
    return new, note + (f" (was {current})" if current else "")


def _apply_padding_free(decision: Decision, setup, outcome: Outcome) -> bool:
    """Flatten the collator (or leave it to the trainer) and guard the model; False where it could not."""
    st = decision.settings
    own = getattr(setup, "trainer_builds_collator", False)
    if st.padding_free_via == "trainer" and setup.data_collator is None:
        note = "the trainer's own collator makes padding-free rows (padding_free=True)"
    else:
        collator, note = pf.flattening_collator(setup.data_collator, setup.processing_class, own)
        if collator is None:
            if st.padding_free_via == "trainer":  # TRL refuses padding_free=True beside a custom collator
                outcome.facts.setdefault("withdrawn_args", []).append("padding_free")
            outcome.fallbacks.append(f"padding_free: {note}; batches keep their padding")
            logger.warning("hf_speedup data fallback: padding_free: %s", note)
            return False
        setup.data_collator = collator
        if st.padding_free_via == "trainer":  # a user collator: the trainer must not be asked to flatten too
            outcome.facts.setdefault("withdrawn_args", []).append("padding_free")
            note += " (your collator, flattened; the trainer's padding_free left off: it refuses custom collators)"
    outcome.facts["padding_free"] = note
    if setup.model is not None and not isinstance(setup.model, str):
        outcome.facts["use_cache_guard"] = pf.guard_use_cache(setup.model)
    return True


def _guard_rows_the_args_flatten(decision: Decision, setup, outcome: Outcome) -> None:
    """The use_cache guard where the trainer's final arguments flatten rows themselves (TRL's ``packing`` or
    ``padding_free``, the user's or the plan's) and hf_speedup's own padding-free did not install it (off in
    the plan, ``baseline``, or fallen back): the trap is the same whoever flattens, and as silent."""
    st = decision.settings
    if "use_cache_guard" in outcome.facts or setup.model is None or isinstance(setup.model, str):
        return
    withdrawn = "padding_free" in outcome.facts.get("withdrawn_args", ())
    why = args_flatten(setup.args, None if withdrawn else st.padding_free_via, st.packing)
    if why is None:
        return
    outcome.facts["use_cache_guard"] = pf.guard_use_cache(setup.model)
    outcome.facts["rows_flattened_by"] = why
    outcome.notes.append(f"use_cache guard on the decoder: {why} makes flattened rows (a cache built on them would "
                         "let each sequence attend to the ones before it)")
    logger.info("hf_speedup data: %s", outcome.notes[-1])


def evaluation_collator(trainer, users_collator, given_collator, users_args):
    """The collator evaluation and prediction batch with where the plan changed the training one, so that they see
    every row as the stock Trainer shows it (not flattened, not padded further); None where training batches with
    the user's own. ``users_collator``: what the user passed; ``given_collator``: what ``Trainer.__init__`` got
    from the plan. Where the user passed none, the Trainer's default for the processing class; where the trainer
    built its own (TRL's) and the plan set its ``padding_free``/``pad_to_multiple_of`` through the arguments, a
    copy of it with the user's values."""
    if users_collator is not None:
        return users_collator if trainer.data_collator is not users_collator else None
    if given_collator is not None:
        from transformers import DataCollatorWithPadding, default_data_collator

        processing_class = getattr(trainer, "processing_class", None)
        return (DataCollatorWithPadding(processing_class) if _is_default_padding_target(processing_class)
                else default_data_collator)
    live = trainer.data_collator
    restore = {name: getattr(users_args, name) for name in ("padding_free", "pad_to_multiple_of")
               if hasattr(live, name) and _args_have(users_args, name)
               and getattr(live, name) != getattr(users_args, name)}
    if not restore:
        return None
    for_eval = copy.copy(live)
    for name, value in restore.items():
        setattr(for_eval, name, value)
    return for_eval


@contextlib.contextmanager
def evaluation_loader(trainer):
    """Around the Trainer's ``get_eval_dataloader``/``get_test_dataloader``: the evaluation collator (see
    :func:`evaluation_collator`) in place while the loader is built."""
    collator = getattr(trainer, "speedup_eval_collator", None)
    if collator is None:
        yield
        return
    training = trainer.data_collator
    trainer.data_collator = collator
    try:
        yield
    finally:
        trainer.data_collator = training
