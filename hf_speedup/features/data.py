"""Input pipeline: pad batches to a multiple of N (stable shapes, fewer recompiles, tensor-core friendly
sizes) and the DataLoader knobs (workers, pinning, prefetch, persistent workers, dropping the last partial
batch) via TrainingArguments.

Every ``data.*`` field left ``None`` keeps the user's TrainingArguments / collator untouched, so the
``baseline`` preset changes nothing. Padding is applied to the collator:

- a collator with a ``pad_to_multiple_of`` attribute (the transformers padding collators) is copied with
  the new value (the user's object is not mutated); one that already pads to a multiple of N is kept;
- no collator and a tokenizer as ``processing_class``: the stock Trainer would build
  ``DataCollatorWithPadding(tokenizer)``, so we build exactly that with ``pad_to_multiple_of=N`` (never a
  collator of another kind: for causal LM that default adds no labels, and we must not change that);
- otherwise (plain function, ``default_data_collator``) padding cannot be applied: reported, not engaged.

Engagement rule: ``engaged`` is True iff every part applied (padding, loader settings) is verified on the
trainer's ``data_collator`` and ``args``; parts that could not apply are listed in ``fallbacks``.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from ..plan_types import Decision, Outcome, PlanContext

NAME = "data"
logger = logging.getLogger("hf_speedup")

ARG_FIELDS = {  # settings key -> TrainingArguments field
    "num_workers": "dataloader_num_workers",
    "pin_memory": "dataloader_pin_memory",
    "prefetch_factor": "dataloader_prefetch_factor",
    "persistent_workers": "dataloader_persistent_workers",
    "drop_last": "dataloader_drop_last",
}


@dataclass(frozen=True)
class Settings:
    pad_to_multiple_of: int | None = None  # applied to the collator
    loader: Mapping[str, Any] = field(default_factory=dict)  # ARG_FIELDS key -> value set in TrainingArguments

    def __post_init__(self) -> None:
        object.__setattr__(self, "loader", MappingProxyType(dict(self.loader)))


# --------------------------------------------------------------------------------------------- decide
def _loader(s, caps, args) -> tuple[dict, list[str], list[str]]:
    """(TrainingArguments-side settings, reasons, fallbacks) for the DataLoader knobs."""
    out, reasons, fallbacks = {}, [], []
    if s.num_workers is not None:
        out["num_workers"] = s.num_workers
        note = " (per process)" if caps.world_size > 1 else ""
        if caps.device_type == "cpu" and s.num_workers and s.num_workers >= caps.cpu_threads:
            note += f"; on CPU they compete with the {caps.cpu_threads} training thread(s)"
        reasons.append(f"{s.num_workers} loader worker(s){note}")
    workers = s.num_workers if s.num_workers is not None else getattr(args, "dataloader_num_workers", 0) or 0
    if s.pin_memory is True and caps.device_type != "cuda":
        # set it off explicitly: TrainingArguments pins by default, which only warns without a GPU
        out["pin_memory"] = False
        fallbacks.append(f"pin_memory: pinned host memory only speeds host-to-GPU copies; off on {caps.device_type}")
    elif s.pin_memory is not None:
        out["pin_memory"] = s.pin_memory
        reasons.append("pinned host memory for async host-to-GPU copies" if s.pin_memory else "no pinned memory")
    for key in ("prefetch_factor", "persistent_workers"):
        value = getattr(s, key)
        if value is None:
            continue
        if value is False:  # turning persistence off is valid with any worker count
            out[key] = False
            continue
        if workers == 0:
            fallbacks.append(f"{key}={value}: only valid with loader workers > 0 (workers = 0 here)")
            continue
        out[key] = value
        reasons.append(f"{key}={value}")
    if s.drop_last is not None:
        out["drop_last"] = s.drop_last
        reasons.append("drop each epoch's last partial batch: under static-shape compile it would compile every "
                       "region again for one step (up to batch_size-1 samples per epoch are skipped, different "
                       "ones each epoch when shuffled)" if s.drop_last else "keep each epoch's last partial batch")
    if s.num_workers == 0 and args is not None:  # the user's worker-only settings would now be invalid
        if getattr(args, "dataloader_prefetch_factor", None) is not None:
            out["prefetch_factor"] = None
            reasons.append("cleared TrainingArguments' prefetch_factor (invalid with 0 workers)")
        if getattr(args, "dataloader_persistent_workers", False):
            out["persistent_workers"] = False
            reasons.append("cleared TrainingArguments' persistent_workers (invalid with 0 workers)")
    return out, reasons, fallbacks


def decide(ctx: PlanContext) -> Decision:
    s, caps = ctx.config.data, ctx.caps
    loader, reasons, fallbacks = _loader(s, caps, ctx.args)
    settings = Settings(pad_to_multiple_of=s.pad_to_multiple_of or None, loader=loader)
    if s.pad_to_multiple_of:
        reasons.insert(0, f"pad batches to a multiple of {s.pad_to_multiple_of}: fewer distinct shapes (fewer "
                          "recompiles), tensor-core friendly sizes (applied to the collator)")
    for fb in fallbacks:
        logger.warning("hf_speedup data fallback: %s", fb)
    requested = _summary({k: v for k, v in vars(s).items() if v is not None})
    applied = _summary({"pad_to_multiple_of": settings.pad_to_multiple_of, **loader})
    reason = "; ".join(reasons) or ("not requested: TrainingArguments' loader settings and collator kept"
                                    if not fallbacks else "nothing applicable")
    return Decision(NAME, requested=requested, applied=applied, reason=reason, settings=settings,
                    fallbacks=tuple(fallbacks))


def _summary(settings: dict) -> str:
    settings = {k: v for k, v in settings.items() if k != "pad_to_multiple_of" or v}
    short = {"pad_to_multiple_of": "pad", "num_workers": "workers", "pin_memory": "pin",
             "prefetch_factor": "prefetch", "persistent_workers": "persistent", "drop_last": "drop_last"}
    return ",".join(f"{short[k]}={v}" for k, v in settings.items()) or "off"


# --------------------------------------------------------------------------------------------- apply
def training_args(decision: Decision, args) -> dict:
    loader = decision.settings.loader
    return {field: loader[key] for key, field in ARG_FIELDS.items() if key in loader}


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


def apply(decision: Decision, setup, outcome: Outcome) -> None:
    multiple = decision.settings.pad_to_multiple_of
    if not multiple:
        return
    collator, note = padded_collator(setup.data_collator, setup.processing_class, multiple)
    outcome.facts["collator_note"] = note
    if collator is None:
        outcome.fallbacks.append(f"pad_to_multiple_of={multiple}: {note}")
        outcome.applied = _summary(dict(decision.settings.loader))
        logger.warning("hf_speedup data fallback: pad_to_multiple_of=%s: %s", multiple, note)
        return
    outcome.facts["padded"] = True
    setup.data_collator = collator


# --------------------------------------------------------------------------------------------- verify
def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    st = decision.settings
    parts, ok, applied = [], True, False
    multiple = st.pad_to_multiple_of if outcome.facts.get("padded") else None
    if multiple:
        applied = True
        have = getattr(trainer.data_collator, "pad_to_multiple_of", None)
        good = bool(have) and have % multiple == 0
        ok = ok and good
        parts.append(f"{type(trainer.data_collator).__name__}.pad_to_multiple_of={have}"
                     + ("" if good else f" - MISMATCH: planned a multiple of {multiple}"))
    for key, field_name in ARG_FIELDS.items():
        if key not in st.loader:
            continue
        applied = True
        want = st.loader[key]
        have = getattr(trainer.args, field_name, None)
        ok = ok and have == want
        parts.append(f"args.{field_name}={have}" + ("" if have == want else f" - MISMATCH: planned {want}"))
    fallbacks = list(decision.fallbacks) + outcome.fallbacks
    if not applied:
        return False, "; ".join(["nothing applied"] + fallbacks)
    if fallbacks:
        parts.append("not applied: " + "; ".join(fallbacks))
    return bool(ok), "; ".join(parts)
