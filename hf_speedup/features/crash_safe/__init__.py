"""Crash-safe checkpoints: a ``checkpoint-N`` is complete or not there, whenever the process is killed.

Why: the stock Trainer writes ``checkpoint-N`` in place and resumes from the highest one without looking inside,
so a SIGKILL (a scheduler's grace period over, the OOM killer) or a full disk during a save leaves a checkpoint
``train(resume_from_checkpoint=True)`` then fails on (missing ``trainer_state.json``, truncated JSON or
tensors) until someone deletes it by hand.

How (the Trainer's own save code writes every file; see ``files.py`` for the folders):

- :class:`CrashSafeMixin` (a base of ``SpeedupMixin``) points the Trainer's ``_save_checkpoint`` at
  ``<output_dir>/_checkpoint-N.staging/`` through ``_get_output_dir``; when it returns, every rank waits for the
  others (a barrier), then the process that saves (``args.should_save``: the main one, or each node's with
  ``save_on_each_node``) fsyncs the files and renames the folder to ``checkpoint-N``, then rotates: checkpoints
  beyond ``save_total_limit`` are renamed to ``_checkpoint-N.deleting`` before they are deleted, and neither
  the checkpoint just written nor ``best_model_checkpoint`` ever is. The interrupt feature's checkpoint and
  transformers' JIT checkpoint go through the same ``_save_checkpoint``; a Hub push of the checkpoint waits
  for the rename. An exception during the save (a full disk) removes the staging folder (freeing the space)
  and is raised as the Trainer raised it.
- With ``save_on_each_node`` every node's main process saves and moves folders; on a shared file system they see
  the same ones, so the main process moves them first and the others after it (:func:`_main_process_first`).
- :func:`resolve_resume` (``SpeedupTrainer.train``): ``resume_from_checkpoint=True`` takes the newest complete
  ``checkpoint-N``; an explicit path that is incomplete falls back to the newest complete one of an earlier
  step beside it. Anything incomplete on the way (a staging folder, a stock Trainer's half-written
  ``checkpoint-N``) is renamed into ``_incomplete_checkpoints/`` with a warning, and the report lists it.

- A checkpoint in transformers' original layout (a mixture of experts' per-expert ``w1/w2/w3``, which the
  Trainer writes and its plain ``load_state_dict`` does not convert back) is resumed through ``from_pretrained``
  for the weights that load leaves out (:mod:`.layout`).
- A resume from a checkpoint whose run had already reached ``max_steps`` (a finished job requeued, or killed after
  its last save) trains no further step: the stock Trainer trains one more.

What differs from the stock Trainer: nothing in the layout of a finished run (same ``checkpoint-N`` names and
files); while a save runs its files are under ``_checkpoint-N.staging/``; after a crash
``_incomplete_checkpoints/`` holds what was set aside. ``enabled: false`` restores the stock Trainer's in-place
writes (for file systems without an atomic directory rename: some object-store mounts).

Engagement rule: ``engaged`` is True iff the trainer's class has :class:`CrashSafeMixin` and its
``_save_checkpoint`` and ``_get_output_dir`` resolve through it (a subclass overriding them must call super).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass

from ... import compat
from ...plan_types import OFF, Decision, Outcome, PlanContext
from . import asynchronous, files, layout

NAME = "crash_safe"
APPLIES_TO = "train"
APPLIED = "staged-rename"
STOCK_TRAINER = "the stock Trainer writes checkpoints in place"  # what training_arguments() users get instead:
STOCK_TRAINER_WARNS = False  # logged at INFO, not warned (a safety net, not an acceleration a preset asks for)
logger = logging.getLogger("hf_speedup")


@dataclass(frozen=True)
class Settings:
    staging: str  # where checkpoint-N is written before the rename (relative to the run's output folder)
    incomplete: str  # where incomplete checkpoints are set aside
    asynchronous: bool = False  # tensors copied to host memory, files written by a background thread
    forced: bool = False  # asynchronous: true (a callback acting on on_save does not make the save synchronous)
    synchronous_because: str | None = None  # why the plan saves synchronously (None: in the background)


# --------------------------------------------------------------------------------------------- decide
def decide(ctx: PlanContext) -> Decision:
    settings = Settings(staging=f"_checkpoint-N{files.STAGING_SUFFIX}/checkpoint-N", incomplete=files.INCOMPLETE_DIR)
    if ctx.config.crash_safe.enabled is False:
        why = ("; asynchronous: false (a background save needs the staging folder)"
               if ctx.config.crash_safe.asynchronous is True else "")
        return Decision(NAME, requested=False, applied=OFF, settings=settings,
                        reason="off: checkpoints are written in place, as the stock Trainer does (a kill during a "
                               "save leaves a checkpoint-N that resume picks and fails on)" + why)
    background, how, fallbacks = asynchronous.plan(ctx)
    settings = Settings(staging=settings.staging, incomplete=settings.incomplete, asynchronous=background,
                        forced=ctx.config.crash_safe.asynchronous is True,
                        synchronous_because=None if background else how)
    return Decision(NAME, requested=True, applied=APPLIED + ("+background" if background else ""), settings=settings,
                    fallbacks=fallbacks, reason=(
        f"checkpoint-N is written in {settings.staging}, fsync'ed and renamed into place once every rank's part is "
        f"on disk; resume takes the newest complete checkpoint and moves incomplete ones into {files.INCOMPLETE_DIR}/; "
        f"rotation renames before it deletes and keeps the newest complete checkpoint; {how}"))


def training_args(decision: Decision, args) -> dict:
    """Nothing TrainingArguments can carry: the stock Trainer writes checkpoints in place."""
    return {}


def apply(decision: Decision, setup, outcome: Outcome) -> None:
    """Nothing before the Trainer exists: :class:`CrashSafeMixin` acts when a checkpoint is saved."""


def callbacks(decision: Decision, trainer, outcome: Outcome) -> list:
    return asynchronous.callbacks(decision, trainer)


# --------------------------------------------------------------------------------------------- verify
def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    if not decision.active:
        return False, decision.reason
    cls = type(trainer)
    if not issubclass(cls, CrashSafeMixin):
        return False, f"{cls.__name__} lacks CrashSafeMixin: checkpoints are written in place"
    saved = outcome.facts.get("committed", 0)
    done = f"; {saved} checkpoint(s) committed this run, the last {outcome.facts.get('last_committed')}" if saved else ""
    done += asynchronous.verified(trainer, decision, outcome)
    for method in ("_save_checkpoint", "_get_output_dir"):
        owner = next(k for k in cls.__mro__ if method in vars(k))
        if owner is not CrashSafeMixin and not saved:  # an override that may or may not call super()
            return False, (f"{owner.__name__}.{method} overrides the staged save: engaged once a checkpoint has "
                           "been committed through the staging folder (it must call super())")
    return True, "the trainer's _save_checkpoint writes into a staging folder and renames it when complete" + done


def _state(trainer) -> tuple[Decision | None, Outcome]:
    plan = getattr(trainer, "speedup_plan", None)
    decision = plan.decisions.get(NAME) if plan is not None else None
    outcomes = getattr(trainer, "speedup_outcomes", None) or {}
    return decision, outcomes.get(NAME) or Outcome()


def _on(trainer) -> bool:
    decision, _ = _state(trainer)
    return decision is not None and decision.active


# --------------------------------------------------------------------------------------------- resume
def resolve_resume(trainer, resume_from_checkpoint):
    """What ``train(resume_from_checkpoint=...)`` resumes from: the newest complete checkpoint (see the module
    docstring); incomplete ones are set aside first (by the saving processes, then every rank agrees)."""
    from transformers.trainer_utils import get_last_checkpoint

    _, outcome = _state(trainer)
    for key in ("resumed_from", "set_aside", "committed", "last_committed"):
        outcome.facts.pop(key, None)
    if not _on(trainer):  # the stock Trainer's own resolution
        if resume_from_checkpoint is True and (last := get_last_checkpoint(trainer.args.output_dir)) is not None:
            return last
        return resume_from_checkpoint
    if resume_from_checkpoint is True:
        run_dir, requested = trainer.args.output_dir, None
    elif isinstance(resume_from_checkpoint, (str, os.PathLike)) and os.path.isdir(resume_from_checkpoint):
        requested = os.fspath(resume_from_checkpoint)
        run_dir = os.path.dirname(os.path.normpath(requested)) or "."
        if files.step_of(requested) is None:  # a folder of the user's own naming: checked, never moved
            why = files.problem(requested)
            if why is not None:
                raise ValueError(f"resume_from_checkpoint = {requested!r} is incomplete: {why}; allowed: a complete "
                                 "checkpoint folder; fix: pass another checkpoint, or True for the newest complete "
                                 "checkpoint-N in output_dir")
            outcome.facts["resumed_from"] = requested
            return requested
    else:  # None / False, or a path that is not there (the Trainer's own error)
        return resume_from_checkpoint
    moved: list[files.SetAside] = []
    with _main_process_first(trainer):
        if trainer.args.should_save:
            moved += files.set_aside_leftovers(run_dir)
            step = files.step_of(requested) if requested else None
            for checkpoint in files.checkpoints_by_step(run_dir):
                if step is not None and files.step_of(checkpoint) > step:
                    continue  # newer than the one asked for: not a candidate, left as it is
                why = files.problem(checkpoint)
                if why is None:
                    break
                moved.append(files.set_aside(checkpoint, run_dir, why))
    trainer.accelerator.wait_for_everyone()  # every rank sees the folder as the saving process left it
    chosen = _newest(run_dir, requested)
    if moved:
        outcome.facts["set_aside"] = [m.to_dict() for m in moved]
    if chosen is None:
        if not moved and requested is None:
            return resume_from_checkpoint  # nothing there at all: the Trainer raises its own error
        what = "; ".join(f"{m.checkpoint} ({m.reason})" for m in moved) or "none"
        raise ValueError(
            f"No valid checkpoint found in output directory ({run_dir}): incomplete checkpoints set aside into "
            f"{os.path.join(run_dir, files.INCOMPLETE_DIR)}: {what}; fix: start without resume_from_checkpoint "
            "(training starts from step 0)")
    if requested is not None and os.path.normpath(chosen) != os.path.normpath(requested):
        logger.warning("hf_speedup crash_safe: resume_from_checkpoint=%s is incomplete; resuming from %s, "
                       "the newest complete checkpoint of an earlier step", requested, chosen)
    outcome.facts["resumed_from"] = chosen
    return chosen


def _newest(run_dir: str, requested: str | None) -> str | None:
    if requested is not None and os.path.isdir(requested):
        return requested
    step = files.step_of(requested) if requested else None
    for checkpoint in files.checkpoints_by_step(run_dir):
        if step is None or files.step_of(checkpoint) <= step:
            return checkpoint
    return None


def _main_process_first(trainer):
    """Where several processes save (``save_on_each_node``, one per node), the main one moves folders first and
    the others after it (accelerate's ``main_process_first``): on a shared file system they find its work done.
    Run side by side, two of them would move the same folder (the second fails on it), or one would take the
    checkpoint the other has just renamed into place for the stale one it replaces and delete it."""
    if trainer.args.save_on_each_node and trainer.args.world_size > 1:
        return trainer.accelerator.main_process_first()
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------------- save
@contextlib.contextmanager
def _discarded_on_error(root: str, run_dir: str, writer: bool):
    """A save that raises (a full disk, a KeyboardInterrupt) will never be complete: its staging folder is
    removed by the saving process, which frees its space, and the error goes on as the Trainer raised it."""
    try:
        yield
    except BaseException as exc:
        if writer:
            files.discard_staging(root, run_dir, f"the save failed: {type(exc).__name__}: {exc}", keep=False)
        raise


class CrashSafeMixin:
    """The Trainer methods a staged save needs; pass-throughs when the feature is off."""

    _speedup_staging: str | None = None  # the staging folder while _save_checkpoint runs
    _speedup_deferred_push: bool = False

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """``resume_from_checkpoint=True`` resolved to the newest complete checkpoint (incomplete ones set aside
        first), so the report can carry its counters over from that checkpoint; True where there is none (the
        Trainer's own error)."""
        resume_from_checkpoint = resolve_resume(self, resume_from_checkpoint)
        self.speedup_resumed_from = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            asynchronous.drain(self)  # train() returns (or raises) once the last checkpoint is written

    def _load_best_model(self, *args, **kwargs):
        """The best checkpoint may be the save still being written: wait for it."""
        asynchronous.drain(self)
        return super()._load_best_model(*args, **kwargs)

    def _run_epoch(self, *args, **kwargs):
        """Nothing left to train (resumed from the checkpoint of a run that reached ``max_steps``): stop, where the
        stock loop would run one more optimizer step before it checks."""
        if _on(self) and 0 < self.state.max_steps <= self.state.global_step:
            logger.info("hf_speedup: resumed at step %d of %d: nothing left to train", self.state.global_step,
                        self.state.max_steps)
            self.control.should_training_stop = True
            return None
        return super()._run_epoch(*args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The Trainer's load, then the weights it left unloaded where the checkpoint is in transformers' original
        layout (:mod:`.layout`)."""
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        if _on(self) and not getattr(self, "is_deepspeed_enabled", False):
            target = self.accelerator.unwrap_model(model if model is not None else self.model)
            if (note := layout.load_original_layout(target, resume_from_checkpoint)) is not None:
                _, outcome = _state(self)
                outcome.notes.append(note)

    def _get_output_dir(self, trial):
        """During a save, the staging folder: the Trainer writes ``<staging>/checkpoint-N``."""
        if self._speedup_staging is not None:
            return self._speedup_staging
        return super()._get_output_dir(trial)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """The Hub upload runs in the background: it reads the checkpoint from its final folder, after the rename."""
        if self._speedup_staging is not None:
            self._speedup_deferred_push = True
            return
        super()._push_from_checkpoint(checkpoint_folder)

    def _save_checkpoint(self, model, trial) -> None:
        if not _on(self):
            return super()._save_checkpoint(model, trial)
        started = time.perf_counter()
        asynchronous.drain(self, adapt=True)  # one save in flight: the previous one is complete (or failed) first
        decision, outcome = _state(self)
        why_sync = asynchronous.sync_reason(self, decision, trial)
        run_dir = super()._get_output_dir(trial)
        step = self.state.global_step
        name = files.checkpoint_name(step)
        root = files.staging_root(run_dir, step)
        writer = self.args.should_save
        with _main_process_first(self):
            if writer and os.path.lexists(root):  # a save of this step that never finished (no resume since)
                moved = files.discard_staging(root, run_dir, "a save of the same step that did not finish", keep=True)
                outcome.facts.setdefault("set_aside", []).extend(m.to_dict() for m in moved)
        self.accelerator.wait_for_everyone()  # no rank writes into the staging folder before it is clean
        self._speedup_best_as_stock(run_dir, step)
        self._speedup_staging, self._speedup_deferred_push = root, False
        writes: list = []
        try:
            with _discarded_on_error(root, run_dir, writer):
                with asynchronous.capture(self, writes) if why_sync is None else contextlib.nullcontext():
                    super()._save_checkpoint(model, trial)
        finally:
            self._speedup_staging = None
        staged = os.path.join(root, name)
        final = os.path.join(run_dir, name)
        collector = getattr(self, "speedup_callback", None)
        if collector is not None:  # the report's counters go in before the rename, like every other file
            collector.carry_into(staged)
        from ..compile import cache as compile_cache

        compile_cache.write_into(self, staged, final)  # the compiled graphs and kernels travel with the checkpoint
        if self.state.best_model_checkpoint == staged:  # the Trainer saw this step's folder under its staging name
            self.state.best_model_checkpoint = final
            if writer:
                self.state.save_to_json(os.path.join(staged, files.TRAINER_STATE))
        if why_sync is None:
            push = self._speedup_deferred_push
            asynchronous.submit(self, writes, root, name, run_dir,
                                lambda: self._speedup_commit(root, name, run_dir, push), outcome,
                                lambda: _count_committed(outcome, final))
            if asynchronous.finishes_run(self):
                asynchronous.drain(self)
        else:
            self.accelerator.wait_for_everyone()  # every rank's part (shards, RNG state) is written
            with _main_process_first(self):
                if writer:
                    with _discarded_on_error(root, run_dir, writer):  # fsync may report a full disk too
                        self._speedup_commit(root, name, run_dir, self._speedup_deferred_push)
            self.accelerator.wait_for_everyone()  # no rank goes on (or exits) before checkpoint-N is in place
            _count_committed(outcome, final)
            if decision.settings.asynchronous:
                outcome.facts.setdefault("synchronous_saves", []).append(f"{name}: {why_sync}")
        self._speedup_deferred_push = False
        asynchronous.record_facts(self, outcome, time.perf_counter() - started, background=why_sync is None)

    def _speedup_commit(self, root: str, name: str, run_dir: str, push: bool) -> None:
        """On the saving process, once every rank's files are written: fsync, rename into place, push, rotate."""
        _, outcome = _state(self)
        final = os.path.join(run_dir, name)
        started = time.perf_counter()
        files.commit(root, name, run_dir)
        outcome.facts["commit_seconds"] = round(time.perf_counter() - started, 4)
        if push:
            super()._push_from_checkpoint(final)
        self._speedup_rotate(run_dir, final)

    def _speedup_best_as_stock(self, run_dir: str, step: int) -> None:
        """``best_model_checkpoint`` as the Trainer sets it from the run folder, which it does not see during a
        staged save: an earlier best step's checkpoint, where it exists (this step's is fixed after the save)."""
        from transformers.trainer_utils import SaveStrategy

        best = getattr(self.state, "best_global_step", None)
        if (best and best != step and self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH,
                                                                   SaveStrategy.BEST)):
            path = os.path.join(run_dir, files.checkpoint_name(best))
            if os.path.exists(path):
                self.state.best_model_checkpoint = path

    def _speedup_rotate(self, run_dir: str, keep: str) -> None:
        """The Trainer's rotation (``save_total_limit``), deleting crash-safely; ``keep`` (the checkpoint just
        committed) and the best checkpoint are never deleted."""
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        checkpoints = compat.checkpoints_oldest_first(self, run_dir)
        if len(checkpoints) <= limit:
            return
        protected = {os.path.normpath(checkpoints[-1]), os.path.normpath(keep)}
        if self.state.best_model_checkpoint is not None:
            protected.add(os.path.normpath(self.state.best_model_checkpoint))
        remaining = len(checkpoints)
        for checkpoint in checkpoints:
            if remaining <= max(limit, len(protected)):
                break
            if os.path.normpath(checkpoint) not in protected:
                logger.info("hf_speedup crash_safe: deleting %s (save_total_limit=%d)", checkpoint, limit)
                try:
                    files.remove(checkpoint, run_dir)
                except OSError as exc:  # as the Trainer's rmtree(ignore_errors=True): never ends a run
                    logger.warning("hf_speedup crash_safe: could not delete %s (%s)", checkpoint, exc)
                remaining -= 1


def _count_committed(outcome: Outcome, final: str) -> None:
    outcome.facts["committed"] = outcome.facts.get("committed", 0) + 1
    outcome.facts["last_committed"] = final


TRAINER_HOOKS = CrashSafeMixin  # the Trainer methods a staged save changes
