"""``verify`` for the data feature: each part applied, checked on the trainer's live collator, model and arguments."""

from __future__ import annotations

from ...plan_types import Decision, Outcome
from . import padding_free as pf
from .loaders import ARG_FIELDS, DROP_LAST_WITHDRAWN, loader_drops_last


def _verify_padding_free(st, trainer) -> tuple[bool, str]:
    """The live collator really makes padding-free rows (a probe batch) and the live model is guarded."""
    collator = trainer.data_collator
    flattens = pf.is_flattening(collator)
    good, note = pf.probe(collator) if flattens else (False, "it does not flatten batches")
    guarded = pf.use_cache_guarded(trainer.model)
    text = (f"padding-free: {type(collator).__name__}: {note}; use_cache guard on the decoder: "
            f"{'yes' if guarded else 'MISSING'}")
    if st.padding_free_via == "trainer" and "padding_free" in getattr(trainer.args, "__dataclass_fields__", {}):
        text += f"; args.padding_free={trainer.args.padding_free}"
    return good and guarded, text


def _verify_args_guard(trainer, outcome: Outcome) -> tuple[bool, str]:
    """The guard installed for rows the trainer's arguments flatten, checked on the live model ("" if none)."""
    why = outcome.facts.get("rows_flattened_by")
    if why is None:
        return True, ""
    guarded = pf.use_cache_guarded(trainer.model)
    return guarded, f"use_cache guard for the rows {why} flattens: {'yes' if guarded else 'MISSING'}"


def _verify_train_drop_last(trainer) -> tuple[bool, str]:
    """Once ``train()`` built it, the training loader drops its last partial batch and the arguments (which the
    evaluation and prediction loaders read) still say what the user said."""
    loader = getattr(getattr(trainer, "callback_handler", None), "train_dataloader", None)
    args_value = getattr(trainer.args, ARG_FIELDS["drop_last"], None)
    if loader is None:
        return True, (f"training loader drops its last partial batch (built by train()); args.dataloader_drop_last="
                      f"{args_value} for evaluation and prediction")
    drops = loader_drops_last(loader)
    return drops is True, (f"training loader drop_last={drops}" + ("" if drops else " - MISMATCH: planned True")
                           + f"; args.dataloader_drop_last={args_value} for evaluation and prediction")


def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    st = decision.settings
    parts, ok, applied = [], True, False
    if st.padding_free and outcome.facts.get("padding_free"):
        applied = True
        good, text = _verify_padding_free(st, trainer)
        ok = ok and good
        parts.append(text)
    multiple = st.pad_to_multiple_of if outcome.facts.get("padded") else None
    if multiple:
        applied = True
        have = getattr(trainer.data_collator, "pad_to_multiple_of", None)
        good = bool(have) and have % multiple == 0
        ok = ok and good
        parts.append(f"{type(trainer.data_collator).__name__}.pad_to_multiple_of={have}"
                     + ("" if good else f" - MISMATCH: planned a multiple of {multiple}"))
    guarded, guard_text = _verify_args_guard(trainer, outcome)
    if st.train_drop_last and DROP_LAST_WITHDRAWN not in outcome.facts:
        applied = True
        good, text = _verify_train_drop_last(trainer)
        ok = ok and good
        parts.append(text)
    withdrawn = set(outcome.facts.get("withdrawn_args", ()))
    for key, field_name in ARG_FIELDS.items():
        if key not in st.loader or field_name in withdrawn:
            continue
        applied = True
        want = st.loader[key]
        have = getattr(trainer.args, field_name, None)
        ok = ok and have == want
        parts.append(f"args.{field_name}={have}" + ("" if have == want else f" - MISMATCH: planned {want}"))
    fallbacks = list(decision.fallbacks) + outcome.fallbacks
    if guard_text:  # a safeguard, not a speed-up: it does not make the feature engaged on its own
        ok = ok and guarded
        parts.append(guard_text)
    if not applied:
        return False, "; ".join(["nothing applied"] + parts + fallbacks)
    if fallbacks:
        parts.append("not applied: " + "; ".join(fallbacks))
    return bool(ok), "; ".join(parts)
