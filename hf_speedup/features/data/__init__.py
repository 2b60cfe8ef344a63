"""Input pipeline: padding-free batches (see :mod:`.padding_free`), or padding to a multiple of N (stable
shapes, fewer recompiles, tensor-core friendly sizes), and the DataLoader knobs (workers, pinning, prefetch,
persistent workers, dropping the last partial batch) via TrainingArguments.

``data.padding_free`` (``auto`` in the auto and fast presets): where the model keeps packed sequences apart,
the collator becomes a flattening one and the model's decoder gets the ``use_cache`` guard. A trainer that
builds its own collator and honours a ``padding_free`` argument (TRL's ``SFTConfig``) is asked to do it
itself, so its collator and data preparation stay its own; one whose trainer ignores it (TRL's ``DPOConfig``:
DPOTrainer switches it off) is not, padding-free is reported not applicable there. Where neither can happen,
the batch keeps its padding and the reason is reported. Rows the trainer's final arguments flatten
(``packing``, ``padding_free``: the user's or the plan's) get the ``use_cache`` guard whatever the plan
says, and count as flattened for ``drop_last`` (packed rows are fewer than the examples: not dropped).
With padding-free rows ``pad_to_multiple_of`` is not applied (there is no padding to round up; under
compile the sequence dimension is dynamic instead). Nor is a preset's ``pad_to_multiple_of`` applied where the
head's loss would see the extra padding (question answering: a softmax over every position of the row; a head
hf_speedup does not know): the rows stay as the collator pads them, and the reason says so.

Every ``data.*`` field left ``None`` keeps the user's TrainingArguments / collator untouched, so the
``baseline`` preset changes nothing. Padding is applied to the collator:

- a collator with a ``pad_to_multiple_of`` attribute (the transformers padding collators) is copied with
  the new value (the user's object is not mutated); one that already pads to a multiple of N is kept;
- no collator and a tokenizer as ``processing_class``: the stock Trainer would build
  ``DataCollatorWithPadding(tokenizer)``, so we build exactly that with ``pad_to_multiple_of=N`` (never a
  collator of another kind: for causal LM that default adds no labels, and we must not change that);
- otherwise (plain function, ``default_data_collator``) padding cannot be applied: reported, not engaged.

Loader settings and your own TrainingArguments: for the two settings presets choose (``pin_memory``,
``drop_last``) a TrainingArguments value you set wins over the config and the reason says so. TrainingArguments
keep no record of which arguments were passed, so a value counts as yours when it differs from the field's
default, or when ``hf_speedup.training_arguments()`` was given it; a default-valued one is replaced and the
reason names it. The plan's ``drop_last=True`` is withdrawn (a reported fallback) where the training set makes
it wrong: fewer rows than one batch (no step at all), or an IterableDataset (the Trainer ignores it there).

Engagement rule: ``engaged`` is True iff every part applied (padding, loader settings) is verified on the
trainer's ``data_collator`` and ``args``; parts that could not apply are listed in ``fallbacks``.

The modules: ``padding_free`` (the flattening collator, the ``use_cache`` guard), ``collators`` (which collator
batches, who flattens rows, the evaluation collator), ``loaders`` (the DataLoader settings, the training loader's
``drop_last``), ``inputs`` (the training set checked against the collator), ``trainer_hooks`` (the Trainer's
loaders, the ``problems`` and ``attach`` hooks) and ``verification`` (``verify``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from .. import sequence_parallel
from ...plan_types import Decision, Outcome, PlanContext
from ..explicit_args import EXPLICIT_ARGS_ATTR, users_choice  # noqa: F401  (EXPLICIT_ARGS_ATTR: re-exported)
from .collators import (_apply_padding_free, _args_have, _guard_rows_the_args_flatten, args_flatten,
                        honours_padding_free, padded_collator)
from .loaders import ARG_FIELDS, _loader, _withdraw_drop_last
# the feature's verify and its part in the trainer (loaders, the training set's check, the evaluation collator)
from .collators import evaluation_collator, evaluation_loader  # noqa: F401
from .loaders import drop_last_problem, train_drop_last, training_loader  # noqa: F401
from .trainer_hooks import TRAINER_HOOKS, attach, problems, stock_trainer_warnings  # noqa: F401
from .verification import verify  # noqa: F401

NAME = "data"
logger = logging.getLogger("hf_speedup")


@dataclass(frozen=True)
class Settings:
    pad_to_multiple_of: int | None = None  # applied to the collator (without padding-free rows, or where they fell back)
    loader: Mapping[str, Any] = field(default_factory=dict)  # ARG_FIELDS key -> value set in TrainingArguments
    padding_free: bool = False
    padding_free_via: str | None = None  # "collator" (ours) | "trainer" (its own padding_free argument)
    packing: bool | None = None  # TRL's SFTConfig.packing, where the trainer's arguments have it
    rows_flattened: bool = False  # batches arrive as flattened rows, by our collator or the trainer's arguments
    # the training loader (only) drops each epoch's last partial batch, where static-shape compile runs (the
    # evaluation and prediction loaders keep every row: TrainingArguments.dataloader_drop_last stays the user's)
    train_drop_last: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "loader", MappingProxyType(dict(self.loader)))


# --------------------------------------------------------------------------------------------- decide
def _padding_free(ctx: PlanContext) -> tuple[str | None, str, list[str]]:
    """(how: "collator" | "trainer" | None, reason, fallbacks) for ``data.padding_free``."""
    asked, info, args = ctx.config.data.padding_free, ctx.model, ctx.args
    if asked is False:
        return None, "", []
    explicit = asked is True
    if sequence_parallel.active_kind(ctx):  # an explicit true was refused there, with its fix
        return None, "padding_free: auto: off under sequence parallelism (each row is split by position)", []
    if info is not None and not info.packed_sequences:
        why = f"padding_free: {info.packed_reason}; batches keep their padding"
        return None, why, [why] if explicit else []
    batch = getattr(args, "per_device_train_batch_size", None)
    if batch == 1 and not explicit:
        return None, "padding_free: auto: one sequence per batch has no padding to remove", []
    if _args_have(args, "padding_free") and not honours_padding_free(args):
        why = (f"padding_free: {type(args).__name__}.padding_free is not honoured by its trainer (TRL's DPOTrainer "
               "switches it off and pads), and that trainer builds its own collator: not applicable here; batches "
               "keep their padding")
        return None, why, [why] if explicit else []
    if _args_have(args, "padding_free"):  # TRL's SFTTrainer builds the collator and prepares the data
        max_length, packing = getattr(args, "max_length", None), getattr(args, "packing", False)
        if max_length is not None and not packing and ctx.config.data.packing is not True:
            can_pack = _args_have(args, "packing")
            why = (f"padding_free: {type(args).__name__}(max_length={max_length}"
                   + (", packing=False" if can_pack else "") + "): TRL refuses padding_free there (it would not "
                   "enforce max_length); set max_length=None once the data is truncated"
                   + (", or packing=True" if can_pack else "") + "; batches keep their padding")
            return None, why, [why]
        return "trainer", (f"padding-free rows: {type(args).__name__}.padding_free=True (the trainer's own "
                           "collator flattens each batch into one row, position_ids restart per sequence)"), []
    note = f"; but {info.miscounted_loss}" if info is not None and info.miscounted_loss else ""
    return "collator", ("padding-free rows: each batch becomes one row of its sequences (position_ids restart per "
                        "sequence, no attention_mask, no padding token computed); same per-sequence logits and "
                        "loss as padded batches" + note), []


# heads whose loss never sees a padded position (labels -100 there, or the class token / last real token read)
PAD_SAFE_HEADS = ("causal_lm", "masked_lm", "seq2seq_lm", "sequence_classification", "token_classification")


def _pad_for_head(pad: int | None, via: str | None, ctx: PlanContext, reasons: list[str]) -> int | None:
    """A preset's ``pad_to_multiple_of`` only where extra padding cannot change the loss: a question-answering
    head's start/end softmax runs over every position, padding included (transformers masks none), so rounding
    the rows up would change its loss and gradients; a head hf_speedup does not know may do the same."""
    head = getattr(ctx.model, "head", None)
    if not pad or via is not None or ctx.model is None or head in PAD_SAFE_HEADS:
        return pad
    from ...model_parts import HEAD_NAMES

    why = (f"the loss of {HEAD_NAMES.get(head, head)} ({ctx.model.architecture}) runs over every position, "
           "padding included" if head == "question_answering" else
           f"{ctx.model.architecture} has {HEAD_NAMES.get(head, head)}: how its loss treats padded positions is "
           "not known")
    if "data.pad_to_multiple_of" in ctx.config.explicit_fields():
        note = f"pad_to_multiple_of={pad}: applied as asked, but {why}: the extra padding changes the loss"
        logger.warning("hf_speedup data: %s", note)
        reasons.append(note)
        return pad
    reasons.append(f"pad_to_multiple_of={pad} not applied: {why}, so extra padding would change the loss "
                   "(batches keep the collator's own padding)")
    return None


def decide(ctx: PlanContext) -> Decision:
    s, caps = ctx.config.data, ctx.caps
    via, pf_reason, pf_fallbacks = _padding_free(ctx)
    packing = s.packing if s.packing is not None and _args_have(ctx.args, "packing") else None
    by_args = args_flatten(ctx.args, via, packing)
    # without a model (``training_arguments()``) the stock Trainer keeps its padding collator: rows stay padded
    flattened = by_args is not None or (via == "collator" and ctx.model is not None)
    packed = by_args if by_args and by_args.endswith(".packing=True") else None
    loader, reasons, fallbacks = _loader(s, caps, ctx.args, flattened=flattened, packed=packed)
    fallbacks = pf_fallbacks + fallbacks
    if s.packing is not None and packing is None:
        fallbacks.append(f"packing={s.packing}: only trainers with a packing argument (TRL's SFTConfig) pack "
                         "examples; use padding_free with this trainer")
    train_drop_last = bool(loader.pop("drop_last", False))
    pad = s.pad_to_multiple_of or None
    explicit, users_pad = users_choice(ctx.args, "pad_to_multiple_of")  # TRL's configs pad in their own collator
    if pad and explicit and _args_have(ctx.args, "padding_free") and "data.pad_to_multiple_of" not in \
            ctx.config.explicit_fields():
        reasons.append(f"kept your {type(ctx.args).__name__}.pad_to_multiple_of={users_pad} over the preset's {pad}")
        pad = None
    pad = _pad_for_head(pad, via, ctx, reasons)
    settings = Settings(pad_to_multiple_of=pad, loader=loader,
                        padding_free=via is not None, padding_free_via=via, packing=packing,
                        rows_flattened=flattened, train_drop_last=train_drop_last)
    if pad and via is None:
        reasons.insert(0, f"pad batches to a multiple of {pad}: fewer distinct shapes (fewer "
                          "recompiles), tensor-core friendly sizes (applied to the collator)")
    if via is not None:
        reasons.insert(0, pf_reason + (f"; pad_to_multiple_of={s.pad_to_multiple_of} not applied (no padding)"
                                       if s.pad_to_multiple_of else ""))
    elif pf_reason and not pf_fallbacks:
        reasons.append(pf_reason)
    if packing is not None:
        reasons.append(f"{type(ctx.args).__name__}.packing={packing}")
    for fb in fallbacks:
        logger.warning("hf_speedup data fallback: %s", fb)
    requested = _summary({k: v for k, v in vars(s).items() if v is not None and v is not False})
    applied = _summary({"padding_free": {"collator": True, "trainer": "trainer"}.get(via),
                        "pad_to_multiple_of": None if via else settings.pad_to_multiple_of, **loader,
                        "train_drop_last": train_drop_last or None, "packing": packing})
    reason = "; ".join(reasons) or ("not requested: TrainingArguments' loader settings and collator kept"
                                    if not fallbacks else "nothing applicable")
    return Decision(NAME, requested=requested, applied=applied, reason=reason, settings=settings,
                    fallbacks=tuple(fallbacks))


def _summary(settings: dict) -> str:
    settings = {k: v for k, v in settings.items()
                if k not in ("pad_to_multiple_of", "padding_free", "packing", "train_drop_last") or v
                or (k == "packing" and v is False)}
    short = {"pad_to_multiple_of": "pad", "num_workers": "workers", "pin_memory": "pin",
             "prefetch_factor": "prefetch", "persistent_workers": "persistent", "drop_last": "drop_last",
             "padding_free": "padding_free", "packing": "packing", "train_drop_last": "train_drop_last"}
    return ",".join(short[k] if k in ("padding_free", "train_drop_last") and v is True else f"{short[k]}={v}"
                    for k, v in settings.items()) or "off"


# --------------------------------------------------------------------------------------------- apply
def training_args(decision: Decision, args) -> dict:
    st = decision.settings
    out = {field: st.loader[key] for key, field in ARG_FIELDS.items() if key in st.loader}
    if st.padding_free_via == "trainer":
        out["padding_free"] = True
    if st.packing is not None:
        out["packing"] = st.packing
    if st.pad_to_multiple_of and not st.padding_free and _args_have(args, "padding_free"):  # TRL pads itself
        out["pad_to_multiple_of"] = st.pad_to_multiple_of
    return out


def apply(decision: Decision, setup, outcome: Outcome) -> None:
    _apply_collator(decision, setup, outcome)
    _guard_rows_the_args_flatten(decision, setup, outcome)
    _withdraw_drop_last(decision, setup, outcome)


def _apply_collator(decision: Decision, setup, outcome: Outcome) -> None:
    st = decision.settings
    if st.padding_free:
        if _apply_padding_free(decision, setup, outcome):
            return
        outcome.applied = _summary({"pad_to_multiple_of": st.pad_to_multiple_of, **st.loader})  # padded after all
    multiple = st.pad_to_multiple_of
    if not multiple:
        return
    if getattr(setup, "trainer_builds_collator", False) and setup.data_collator is None:
        if _args_have(setup.args, "padding_free"):  # TRL: training_args passes pad_to_multiple_of to its collator
            outcome.facts["padded"] = True
            outcome.facts["collator_note"] = (f"{type(setup.args).__name__}.pad_to_multiple_of={multiple} (the "
                                              "trainer's own collator pads)")
        else:
            note = "the trainer class builds its own collator (none was given); it is left as it is"
            outcome.fallbacks.append(f"pad_to_multiple_of={multiple}: {note}")
            outcome.applied = _summary(dict(st.loader))
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
