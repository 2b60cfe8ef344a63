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
compile the sequence dimension is dynamic instead).

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
"""

from __future__ import annotations

import contextlib
import copy
import logging
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from ... import compat
from ...plan_types import Decision, Outcome, PlanContext
from ..explicit_args import EXPLICIT_ARGS_ATTR, users_choice  # noqa: F401  (EXPLICIT_ARGS_ATTR: re-exported)
from . import padding_free as pf

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
def _loader(s, caps, args, flattened: bool = False, packed: str | None = None) -> tuple[dict, list[str], list[str]]:
    """(TrainingArguments-side settings, reasons, fallbacks) for the DataLoader knobs; ``flattened``: batches
    are padding-free rows, whose length changes every batch anyway; ``packed``: the trainer packs several
    examples per row (named), so the training set's row count is only known after it has packed."""
    out, reasons, fallbacks = {}, [], []
    if s.num_workers is not None:
        out["num_workers"] = s.num_workers
        note = " (per process)" if caps.world_size > 1 else ""
        if caps.device_type == "cpu" and s.num_workers and s.num_workers >= caps.cpu_threads:
            note += f"; on CPU they compete with the {caps.cpu_threads} training thread(s)"
        reasons.append(f"{s.num_workers} loader worker(s){note}")
    workers = s.num_workers if s.num_workers is not None else getattr(args, "dataloader_num_workers", 0) or 0
    if s.pin_memory is not None and _kept_users_choice("pin_memory", s.pin_memory, args, reasons):
        pass
    elif s.pin_memory is True and caps.device_type != "cuda":
        # TrainingArguments' own value stays (the stock Trainer's: torch only warns where nothing is pinned)
        fallbacks.append(f"pin_memory: pinned host memory only speeds host-to-GPU copies; not applicable on "
                         f"{caps.device_type} (TrainingArguments.dataloader_pin_memory left as it is)")
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
    if s.drop_last is True and packed:
        reasons.append(f"drop_last not applied: {packed} packs several examples per row, so how many rows (and "
                       "whether one full batch) remain is only known once the trainer has packed; dropping the last "
                       "partial batch could leave no step at all")
    elif s.drop_last is True and flattened:
        reasons.append("drop_last not applied: padding-free rows are one row of a new length every batch (compiled "
                       "with a dynamic sequence dimension), so a partial last batch costs no recompile and no sample "
                       "is skipped")
    elif s.drop_last is True and getattr(args, ARG_FIELDS["drop_last"], False):
        reasons.append("drop_last: your TrainingArguments.dataloader_drop_last=True already drops the last partial "
                       "batch (in every loader, evaluation included, as with the stock Trainer)")
    elif s.drop_last is True and not _kept_users_choice("drop_last", s.drop_last, args, reasons):
        out["drop_last"] = True
        reasons.append(TRAIN_DROP_LAST)
    elif s.drop_last is False:
        _kept_users_choice("drop_last", s.drop_last, args, reasons)
    if s.num_workers == 0 and args is not None:  # the user's worker-only settings would now be invalid
        if getattr(args, "dataloader_prefetch_factor", None) is not None:
            out["prefetch_factor"] = None
            reasons.append("cleared TrainingArguments' prefetch_factor (invalid with 0 workers)")
        if getattr(args, "dataloader_persistent_workers", False):
            out["persistent_workers"] = False
            reasons.append("cleared TrainingArguments' persistent_workers (invalid with 0 workers)")
    return out, reasons, fallbacks


TRAIN_DROP_LAST = ("drop each epoch's last partial training batch where the blocks compile with static shapes: it "
                   "would compile every region again for one step (up to batch_size-1 training samples per epoch "
                   "are skipped, different ones each epoch when shuffled); the training loader only: evaluation and "
                   "prediction see every row")


# The loader settings presets choose. Where your TrainingArguments chose otherwise, yours are kept; the other
# data.* loader fields are set by no preset, so a value for them in the config is your choice and is applied.
PRESET_LOADER_KEYS = ("pin_memory", "drop_last")


def _kept_users_choice(key: str, wanted: Any, args, reasons: list[str]) -> bool:
    """True (and why, in ``reasons``) where the user's explicit TrainingArguments value wins over the config's."""
    name = ARG_FIELDS[key]
    explicit, have = users_choice(args, name)
    if key not in PRESET_LOADER_KEYS or not explicit or have == wanted:
        return False
    reasons.append(f"{key}: kept your TrainingArguments.{name}={have!r} over the config's {key}={wanted!r} (an "
                   f"explicit TrainingArguments choice wins over a preset)")
    logger.info("hf_speedup data: %s", reasons[-1])
    return True


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


def _padding_free(ctx: PlanContext) -> tuple[str | None, str, list[str]]:
    """(how: "collator" | "trainer" | None, reason, fallbacks) for ``data.padding_free``."""
    asked, info, args = ctx.config.data.padding_free, ctx.model, ctx.args
    if asked is False:
        return None, "", []
    explicit = asked is True
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


def apply(decision: Decision, setup, outcome: Outcome) -> None:
    _apply_collator(decision, setup, outcome)
    _guard_rows_the_args_flatten(decision, setup, outcome)
    _withdraw_drop_last(decision, setup, outcome)


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


DROP_LAST_WITHDRAWN = "train_drop_last_withdrawn"  # Outcome.facts: why the plan's train_drop_last is not applied


def _withdraw_drop_last(decision: Decision, setup, outcome: Outcome) -> None:
    """The plan's train_drop_last, withdrawn (a reported fallback) where this training set makes it wrong:
    fewer rows than one batch (the run would take no step at all), or an IterableDataset (the Trainer does
    not pass drop_last to its loader: the last partial batch comes anyway)."""
    if not decision.settings.train_drop_last:
        return
    why = drop_last_problem(getattr(setup, "train_dataset", None), setup.args)
    if why is None:
        return
    _withdraw(decision, outcome, why)


def _withdraw(decision: Decision, outcome: Outcome, why: str) -> None:
    outcome.facts[DROP_LAST_WITHDRAWN] = why
    outcome.fallbacks.append(f"drop_last=True: {why}; the last partial batch is kept")
    outcome.applied = ",".join(p for p in (outcome.applied or decision.applied).split(",")
                               if p != "train_drop_last") or "off"
    logger.warning("hf_speedup data fallback: drop_last=True: %s; the last partial batch is kept", why)


@contextlib.contextmanager
def training_loader(trainer):
    """Around the Trainer's ``get_train_dataloader``: ``args.dataloader_drop_last`` reads True while it builds the
    training loader, where :func:`train_drop_last` says so; the user's value is back before anything else reads
    it (the evaluation and prediction loaders)."""
    plan, outcomes = getattr(trainer, "speedup_plan", None), getattr(trainer, "speedup_outcomes", None)
    if plan is None or not train_drop_last(plan, outcomes["data"]):
        yield
        return
    field_name = ARG_FIELDS["drop_last"]
    users = getattr(trainer.args, field_name)
    setattr(trainer.args, field_name, True)
    try:
        yield
    finally:
        setattr(trainer.args, field_name, users)


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


def train_drop_last(plan, outcome: Outcome) -> bool:
    """Whether the training loader drops its last partial batch: your config's ``data.drop_last: true``, or a
    preset's where the blocks compile with static shapes (elsewhere a partial batch costs no recompile: the
    preset's choice is withdrawn and the report says so, once)."""
    if not plan["data"].settings.train_drop_last or DROP_LAST_WITHDRAWN in outcome.facts:
        return False
    compiled = plan["compile"]
    static = compiled.active and getattr(compiled.settings, "dynamic", None) is not True
    if static or "data.drop_last" in plan.config.explicit_fields():
        return True
    _withdraw(plan["data"], outcome, "nothing compiles with static shapes in this run ("
              + (f"compile: {compiled.applied}, dynamic sequence dimension" if compiled.active else
                 "compile is off") + "), so a partial last batch costs no recompile")
    return False


def global_batch(args) -> tuple[int, int]:
    """(rows per optimizer micro-step over all processes, processes), without initialising torch.distributed."""
    import os

    try:
        world = max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        world = 1
    return int(getattr(args, "per_device_train_batch_size", 8) or 8) * world, world


def drop_last_problem(dataset, args) -> str | None:
    """Why dropping the last partial batch is wrong for ``dataset`` (None where it is fine or unknown)."""
    import torch

    if dataset is None:
        return None
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return ("the training set is an IterableDataset: the Trainer passes drop_last only to map-style datasets' "
                "loaders")
    try:
        rows = len(dataset)
    except TypeError:
        return None
    batch, world = global_batch(args)
    if 0 < rows < batch:
        return (f"the training set has {rows} row(s), fewer than one batch ({batch // world} per device x {world} "
                "process(es)): every row would be dropped and training would take no step")
    return None


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


# --------------------------------------------------------------------------------------------- verify
def _verify_padding_free(st: Settings, trainer) -> tuple[bool, str]:
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


def loader_drops_last(loader) -> bool | None:
    """The ``drop_last`` a (possibly accelerate-prepared) DataLoader batches with; None where it cannot be read."""
    for obj in (loader, getattr(loader, "batch_sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)):
        if isinstance(getattr(obj, "drop_last", None), bool) and obj is not loader:
            return obj.drop_last
    return getattr(loader, "drop_last", None)


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
