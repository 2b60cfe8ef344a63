"""Asynchronous checkpoints: training stops for the host copy of the state, not for the disk.

The stock Trainer stops training until every file of a checkpoint is written (a SmolLM2-135M full fine-tune's
1.6 GB: seconds per save). Here the Trainer's own ``_save_checkpoint`` runs as it is, into the staging folder, with
its tensor files caught (:mod:`.capture`): their tensors are copied into host buffers kept across saves
(:mod:`.staging`) and a writer thread (:mod:`.background`) writes them, fsyncs the folder and renames it into place,
then rotates. What ``crash_safe`` promises stays: the folder becomes ``checkpoint-N`` (visible to resume) only once
every rank's files are written, the rename is the last thing done, and rotation runs after it (never deleting the
checkpoint just committed). One save is in flight: the next waits for it, and that wait is blocked time.
``train()`` returns only after the last write (the final step's save waits for its own write; the interrupt
feature's save is a final one); ``load_best_model_at_end`` waits too. A write that fails (a full disk, a read-only
folder) leaves the previous checkpoint as it was: its staging folder is removed, a warning and the report say
so, and training goes on (the next save tries again).

Saved synchronously, with the reason in the plan or the report: under DeepSpeed (its engine writes its own files,
with its own barriers and ``latest`` tag), a hyperparameter-search trial, ``save_on_each_node`` over several
processes (each node's saving process moves folders in turn), a callback other than the known ones that acts on
``on_save`` (it may read the checkpoint's files; ``asynchronous: true`` saves in the background anyway), and a
file whose host copy does not fit in half the host memory free when the save starts (that file only).
"""

from __future__ import annotations

import logging
import os

from . import files
from .background import BackgroundWriter, all_ranks_agree
from .capture import deferred_writes
from .staging import HostStage

logger = logging.getLogger("hf_speedup")

ON = ("tensors copied into host buffers kept across saves (pinned on CUDA); the files written, fsync'ed and renamed "
      "into place by a background thread while training goes on; one save in flight (the next waits for it)")
# callbacks whose on_save reads nothing of the checkpoint's files (the Trainer's own; hf_speedup's)
_KNOWN_ON_SAVE = ("transformers.trainer_callback", "hf_speedup.")


def plan(ctx) -> tuple[bool, str, tuple[str, ...]]:
    """(in the background, the reason, fallbacks) for the plan: what is known before the Trainer exists."""
    setting = ctx.config.crash_safe.asynchronous
    if setting is False:
        return False, "saved synchronously (asynchronous: false): training waits until every file is written", ()
    deepspeed = ctx.decisions.get("deepspeed")
    if deepspeed is not None and deepspeed.active:
        why = ("saved synchronously: DeepSpeed's engine writes its own checkpoint (save_checkpoint, with its own "
               "barriers and 'latest' tag) and cannot save in the background")
        return False, why, ((f"crash_safe.asynchronous: true -> synchronous: {why}",) if setting is True else ())
    if setting is not True and (busy := _cores_kept_busy(ctx.caps)) is not None:
        return False, busy, ()
    return True, ON, ()


def _cores_kept_busy(caps) -> str | None:
    """Why a background write would take its CPU from the steps (None: there are idle cores, or a GPU trains)."""
    if caps.device_type != "cpu" or not caps.cpu_cores:
        return None
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    threads = caps.cpu_threads * processes
    if threads < caps.cpu_cores:
        return None
    return (f"saved synchronously: training keeps every core of this CPU busy ({threads} thread(s) on {caps.cpu_cores} "
            "core(s)), so a background write takes its CPU from the steps (SmolLM2-135M on 2 cores: the steps beside "
            "a write 1.2-3x slower and no shorter run, benchmarks/RESULTS.md); crash_safe.asynchronous: true saves "
            "in the background anyway")


def writer_of(trainer) -> BackgroundWriter:
    writer = getattr(trainer, "_speedup_background", None)
    if writer is None:
        writer = trainer._speedup_background = BackgroundWriter()
        trainer._speedup_host_stage = HostStage()
    return writer


def drain(trainer, adapt: bool = False) -> float:
    """Wait for the save in flight (if any); the seconds waited. ``adapt``: a save is waiting for it (the writer's
    priority follows, see :mod:`.background`)."""
    writer = getattr(trainer, "_speedup_background", None)
    return writer.wait(adapt) if writer is not None else 0.0


def _on_save_readers(trainer) -> list[str]:
    from transformers import TrainerCallback

    out = []
    for cb in trainer.callback_handler.callbacks:
        cls = type(cb)
        owner = next((k for k in cls.__mro__ if "on_save" in vars(k)), TrainerCallback)
        if owner is TrainerCallback or owner.__module__.startswith(_KNOWN_ON_SAVE):
            continue
        if cls.__name__ == "WandbCallback" and not getattr(getattr(cb, "_log_model", None), "is_enabled", True):
            continue  # W&B reads the checkpoint only to upload it (WANDB_LOG_MODEL=checkpoint)
        out.append(cls.__name__)
    return out


def sync_reason(trainer, decision, trial) -> str | None:
    """Why this save is synchronous (None: in the background); the same on every rank."""
    settings = decision.settings
    if not settings.asynchronous:
        return "planned synchronous"
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False):
        return "DeepSpeed's engine writes its own checkpoint and cannot save in the background"
    if trial is not None or getattr(trainer, "hp_search_backend", None) is not None:
        return "a hyperparameter-search trial"
    if args.save_on_each_node and args.world_size > 1:
        return "save_on_each_node: each node's saving process moves the folders in turn"
    if not settings.forced and (readers := _on_save_readers(trainer)):
        return (f"the callback(s) {', '.join(readers)} act on on_save and may read the checkpoint's files, which a "
                "background save writes later; crash_safe.asynchronous: true saves in the background anyway")
    return None


def capture(trainer, writes: list):
    """The context the Trainer's save runs in: tensor files queued on ``writes`` (every rank makes the writers'
    process group at its first background save)."""
    group = writer_of(trainer).group()
    trainer._speedup_host_stage.begin()
    return deferred_writes(trainer._speedup_host_stage, writes, group)


def submit(trainer, writes: list, root: str, name: str, run_dir: str, commit, outcome, committed) -> None:
    """Start the background part: the queued writes, then (once every rank's are done) ``commit()`` on the saving
    process and ``committed()`` on every rank; a failure removes the staging folder and is reported."""
    background = writer_of(trainer)
    committed_everywhere = committed
    stage = trainer._speedup_host_stage
    saver = trainer.args.should_save
    group = background.group()
    step = files.step_of(name)
    if stage.no_room:
        note = f"{name}: written synchronously: {'; '.join(stage.no_room)}"
        logger.warning("hf_speedup crash_safe: %s", note)
        outcome.facts.setdefault("synchronous_files", []).append(note)

    def work() -> None:
        error: BaseException | None = None
        try:
            for w in writes:
                w.run()
            background.record.written_bytes += sum(w.nbytes for w in writes)
        except BaseException as exc:  # noqa: BLE001
            error = exc
        everyone = all_ranks_agree(group, error is None)
        committed = False
        if saver:
            if everyone:
                try:
                    commit()
                    committed = True
                except BaseException as exc:  # noqa: BLE001
                    error = error or exc
            if not committed:
                files.discard_staging(root, run_dir, f"the background save failed: {error or 'on another rank'}",
                                      keep=False)
        if all_ranks_agree(group, committed or not saver):
            background.record.saved += 1
            committed_everywhere()
            return
        _failed(background, outcome, name, step, error)

    background.submit(name, work)


def _failed(background, outcome, name: str, step, error) -> None:
    what = f"{type(error).__name__}: {error}" if error is not None else "another rank's part failed"
    last = outcome.facts.get("last_committed")
    logger.warning("hf_speedup crash_safe: the background save of %s failed (%s); nothing of it is visible to resume, "
                   "the newest complete checkpoint (%s) is intact; training goes on and the next save tries again",
                   name, what, last or "none yet")
    entry = {"step": step, "error": what}
    background.record.failed.append(entry)
    outcome.facts.setdefault("failed_saves", []).append(entry)


def finishes_run(trainer) -> bool:
    """This save is the run's last (the final step, or a stop: the interrupt feature's save), or made outside
    ``train()`` (a direct ``_save_checkpoint`` call expects its files when it returns): wait for its write."""
    state = trainer.state
    return (bool(trainer.control.should_training_stop) or (0 < state.max_steps <= state.global_step)
            or not getattr(trainer, "is_in_train", True))


def record_facts(trainer, outcome, blocked: float, background: bool) -> None:
    facts = outcome.facts
    key = "saves_background" if background else "saves_synchronous"
    facts[key] = facts.get(key, 0) + 1
    facts["blocked_seconds"] = round(facts.get("blocked_seconds", 0.0) + blocked, 4)
    writer = getattr(trainer, "_speedup_background", None)
    if writer is not None:
        rec = writer.record
        facts.update(background_write_seconds=round(rec.write_seconds, 4),
                     waited_for_previous_seconds=round(rec.waited_seconds, 4),
                     writer_niceness=rec.niceness,
                     host_staging_bytes=trainer._speedup_host_stage.held_bytes)



def callbacks(decision, trainer) -> list:
    """At train end the last background save is finished before the report (a callback after this one) is
    written, so it counts that save."""
    if not (decision.active and decision.settings.asynchronous):
        return []
    from transformers import TrainerCallback

    class WrittenBeforeTheReport(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            drain(trainer)

    return [WrittenBeforeTheReport()]


def verified(trainer, decision, outcome) -> str:
    """What the background saves of this run did (or why it saves synchronously), for the report's reason."""
    writer = getattr(trainer, "_speedup_background", None)
    out = f"; {decision.settings.synchronous_because}" if decision.settings.synchronous_because else ""
    if writer is not None and writer.record.saved:
        rec = writer.record
        out += (f"; {rec.saved} written by the background thread ({rec.written_bytes / 2**20:.1f} MiB in "
                f"{rec.write_seconds:.2f} s beside training; training blocked {outcome.facts.get('blocked_seconds', 0)}"
                " s in all its saves)")
    if outcome.facts.get("failed_saves"):
        out += f"; {len(outcome.facts['failed_saves'])} background save(s) FAILED: {outcome.facts['failed_saves']}"
    return out
