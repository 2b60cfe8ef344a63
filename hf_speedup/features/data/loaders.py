"""The DataLoader settings ``data.*`` puts in TrainingArguments, and the training loader's ``drop_last``.

Which loader knobs the plan sets (a TrainingArguments value you chose wins over a preset's), where the plan's
``drop_last`` is withdrawn (too few rows, an IterableDataset, nothing compiling with static shapes), and the
switch that makes the training loader alone drop its last partial batch.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from ...plan_types import Decision, Outcome
from ..explicit_args import users_choice

logger = logging.getLogger("hf_speedup")

ARG_FIELDS = {  # settings key -> TrainingArguments field
    "num_workers": "dataloader_num_workers",
    "pin_memory": "dataloader_pin_memory",
    "prefetch_factor": "dataloader_prefetch_factor",
    "persistent_workers": "dataloader_persistent_workers",
    "drop_last": "dataloader_drop_last",
}


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


def loader_drops_last(loader) -> bool | None:
    """The ``drop_last`` a (possibly accelerate-prepared) DataLoader batches with; None where it cannot be read."""
    for obj in (loader, getattr(loader, "batch_sampler", None),
                getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)):
        if isinstance(getattr(obj, "drop_last", None), bool) and obj is not loader:
            return obj.drop_last
    return getattr(loader, "drop_last", None)
