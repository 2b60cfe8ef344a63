"""The collector: a TrainerCallback that verifies the plan, measures the run and hands the report to the sinks.

How it measures without adding device synchronisation:

- tokens: :class:`SpeedupTrainer.training_step` hands every micro-batch to :meth:`count_batch`, which
  sums ``attention_mask`` *on the device* (no ``.item()``);
- time: host clock at each ``on_step_end`` (step-to-step wall time, data loading included);
- at a logging step the Trainer has just synchronised (it reads the loss with ``.item()``); only then
  are the token counts read and, in multi-process runs, gathered in one small collective (tokens and
  samples summed over ranks, memory maxed);
- memory: allocator statistics (host-side queries); compile: dynamo's counters (host-side).

Per logging step the metrics go to the ``report_to`` trackers' ``on_log`` beside the Trainer's training log, as
``hf_speedup/<metric>`` (``callback_handler.SpeedupCallbackHandler``); ``state.log_history`` and the other callbacks
keep the stock logs, so ``trainer_state.json`` does not depend on wall-clock figures. W&B's callback, which files
training logs under ``train/``, gets them under their own key (``sinks.route_wandb_metrics``). At the end the
summary (steady-state figures and, beside them, the whole run's: wall clock with every compile and recompile, and
the seconds they took) goes to the trackers the same way and into the W&B run summary as ``hf_speedup/<metric>``
(the plan goes to the W&B config as ``hf_speedup/<feature>/<field>``), written where ``report.path`` says
(``<output_dir>/speedup_report.json`` by default) and printed. ``baseline`` turns the file, the trackers and the
printing off. Only the main process prints and writes.

The callback holds the hooks; its collaborators do the work: :class:`~.step_clock.StepClock` (step times,
warm-up steps), :class:`~.log_windows.LogWindows` (a window per training log), :mod:`.run_summary` (the whole
run's totals and the end-of-train summary), :class:`~.model_facts.ModelFacts` (sizes and peak FLOP/s for MFU),
:mod:`.carry` (the counters a checkpoint carries into a resume), :class:`~.goodput.RunClock` (where the wall clock
goes from process start: set-up, compile, steps, saves, evaluation, data, other; goodput).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os

from transformers import TrainerCallback

from ..features.compile.payback import OPENED_AFTER_STEP
from . import carry
from . import goodput as G
from . import measure as M
from . import sinks
from .log_windows import LogWindows
from .model_facts import ModelFacts, num_devices
from .run_summary import run_totals, summarize
from .schema import PREFIX, STEP_METRICS, SUMMARY_METRICS, Metrics
from .step_clock import StepClock

logger = logging.getLogger("hf_speedup")


def _never_breaks_training(on_failure=None):
    """Reporting must never end a run: a hook that fails logs a warning, turns reporting off for the rest of
    the run (the report keeps what it had) and returns ``on_failure(*args)`` (e.g. the logs unchanged)."""

    def wrap(method):
        @functools.wraps(method)
        def guarded(self, *args, **kwargs):
            try:
                return method(self, *args, **kwargs)
            except Exception as exc:
                self.active = False
                logger.warning("hf_speedup: reporting failed in %s (%r); training goes on, the report stays "
                               "incomplete", method.__name__, exc, exc_info=True)
                return on_failure(*args) if on_failure is not None else None

        return guarded

    return wrap


class SpeedupCallback(TrainerCallback):
    """Created by :class:`~hf_speedup.trainer.SpeedupTrainer`; ``trainer`` is that trainer."""

    def __init__(self, trainer, *, print_tables: bool | None = None, max_history: int = 1024,
                 max_step_times: int = 4096) -> None:
        self.trainer = trainer
        self.settings = trainer.speedup_plan.config.report  # where the report goes (``report:`` section)
        self.print_tables = self.settings.console if print_tables is None else print_tables
        self.max_history = max_history
        self.max_step_times = max_step_times
        self.counter = M.TokenCounter()
        self.facts = ModelFacts()
        self.facts.describe(trainer.model)  # now, before accelerate/FSDP wraps or shards it
        self.facts.resolve_peak(trainer)  # a malformed HF_SPEEDUP_PEAK_FLOPS fails here, before training
        self.active = False
        self.finalized = False
        self._carried_at: int | None = None  # the step whose checkpoint has the counters (carry_into)

    # ------------------------------------------------------------------------------------ set-up
    def _reset(self, args) -> None:
        if self.settings.trackers:
            sinks.route_wandb_metrics(self.trainer.callback_handler.callbacks)
        self.counter.reset()
        self.active = True
        self.finalized = False
        self.clock = StepClock(self.max_step_times)
        self.run_clock = G.RunClock()  # where the wall clock goes: set-up, compile, steps, saves, ... (goodput)
        self.windows = LogWindows(self.max_history)
        self.carried = carry.Carried()  # counts of the runs before a resume (none: a fresh run)
        self.resumed_from = self.carry_note = None
        self.memory = M.MemoryWatch(self.trainer)  # the estimate; one step's live tensors on request

    def _restore_carried(self) -> None:
        """A resumed run starts from the counts saved in its checkpoint (``report/carry.py``)."""
        path = getattr(self.trainer, "speedup_resumed_from", None)
        if path:
            carried, self.carry_note = carry.read(path)
            self.resumed_from = str(path)
            if carried is not None:
                self.carried = carried

    # ------------------------------------------------------------------- hooks from the trainer
    @_never_breaks_training()
    def count_batch(self, inputs) -> None:
        """Called by ``SpeedupTrainer.training_step`` for every micro-batch (device-side sum, no sync)."""
        if self.active:
            self.counter.add(inputs)
            self.memory.batch(inputs)

    @contextlib.contextmanager
    def phase(self, name: str):
        """Called by ``SpeedupTrainer`` around ``get_batch_samples`` ("data") and ``evaluate`` ("eval"): the
        main thread's time inside goes to that part of the wall clock (report/goodput.py)."""
        clock = getattr(self, "run_clock", None) if self.active else None
        entered = False
        if clock is not None:
            try:
                clock.enter(name)
                entered = True
            except Exception as exc:  # a report must never end a run
                logger.warning("hf_speedup: timing %s failed (%r); the report's time split stays incomplete", name, exc)
        try:
            yield
        finally:
            if entered:
                try:
                    clock.leave(name)
                except Exception as exc:
                    logger.warning("hf_speedup: timing %s failed (%r)", name, exc)

    @_never_breaks_training(on_failure=lambda logs: {})
    def metrics_for_log(self, logs: dict) -> dict:
        """Called by ``SpeedupTrainer.log`` on every process: the ``hf_speedup/*`` metrics for the trackers to log
        beside a training log (empty for other logs, or with ``report.trackers: false``). Measures either way: the
        window goes into the report's history."""
        if not self.active or not isinstance(logs, dict):
            return {}
        values: dict = {}
        if "train_runtime" in logs:  # the Trainer's end-of-training log
            if not self.finalized:
                self.finalize()
            values = self._log_values(dataclasses.asdict(self.trainer.speedup_report.metrics), SUMMARY_METRICS)
        elif "loss" in logs and not any(k.startswith(("eval_", "test_")) for k in logs):
            step = self.trainer.state.global_step
            if self.windows.due(step, self.clock):
                self.windows.last_logged_step = step
                values = self._log_values(self._window(), STEP_METRICS)
        return values if self.settings.trackers else {}

    @staticmethod
    def _log_values(values: dict, keys) -> dict:
        out = {}
        for k in keys:
            v = values.get(k)
            if v is None or (isinstance(v, float) and not math.isfinite(v)):
                continue  # trackers cannot plot a null; the JSON report keeps it
            out[PREFIX + k] = v
        return out

    # ------------------------------------------------------------------------------ measuring
    def _gather(self) -> dict:
        """Totals of all ranks (tokens, samples summed; memory maxed). Reads the device: call it only
        where the Trainer synchronises anyway. Every process must call it (one collective)."""
        import torch

        mem = M.memory_snapshot(self.facts.device_type, getattr(self.trainer.args, "device", None))
        acc = getattr(self.trainer, "accelerator", None)
        if acc is not None and getattr(acc, "num_processes", 1) > 1:
            device = self.trainer.args.device
            memory = torch.tensor([mem[k] for k in M.RANK_FIELDS[len(M.COUNTS):]], dtype=torch.int64, device=device)
            row = torch.cat([self.counter.totals_tensor(device).to(torch.int64), memory])
            rows = acc.gather(row.unsqueeze(0)).reshape(-1, len(M.RANK_FIELDS)).tolist()
        else:
            rows = [[*self.counter.totals_tensor().tolist(), *[mem[k] for k in M.RANK_FIELDS[len(M.COUNTS):]]]]
        return M.aggregate_ranks(rows)

    def _window(self) -> dict:
        agg = self._gather()
        return self.windows.close(agg, self.clock, self.facts, num_devices(self.trainer),
                                  self.trainer.state.global_step)

    def _totals(self, agg: dict, bounded: bool = False, split: dict | None = None) -> carry.Carried:
        return run_totals(self.carried, self.clock, self.windows.history, agg, self.trainer.state.global_step,
                          self.max_history, self.max_step_times, bounded, split)

    def finalize(self) -> Metrics:
        """Steady-state summary of the run into ``trainer.speedup_report`` (every process calls it)."""
        agg = self._gather()
        split = self.run_clock.split()  # the wall clock stops here
        self.run_clock.close()
        total = self._totals(agg, split=split)  # a resumed run: the whole run, counts carried from its checkpoint
        metrics, measurement = summarize(total, agg, self.clock, self.facts, num_devices(self.trainer), self.trainer,
                                         self.memory, self.resumed_from, self.carry_note, split=split,
                                         origin=self.run_clock.origin_source)
        report = self.trainer.speedup_report
        report.metrics = metrics
        report.measurement = measurement
        report.history = total.history
        report.step_times = total.step_times
        self.finalized = True
        return metrics

    # ------------------------------------------------------------------------------ callbacks
    @_never_breaks_training()
    def on_train_begin(self, args, state, control, **kwargs):
        self._reset(args)
        self._restore_carried()
        self.facts.describe(self.trainer.model)  # a model made by ``model_init`` inside ``train()``
        self.trainer.verify_speedup()
        self.facts.resolve_peak(self.trainer)
        self.facts.measure_matmul_peak(self.trainer)  # once per machine (cached); not with HF_SPEEDUP_MEASURE=0
        M.reset_peak_memory(self.facts.device_type, getattr(args, "device", None))
        report = self.trainer.speedup_report
        report.environment = M.environment(self.trainer.speedup_plan.caps)
        report.environment["world_size"] = num_devices(self.trainer)
        report.metrics, report.measurement, report.history, report.step_times = Metrics(), {}, [], []
        if state.is_world_process_zero:
            if self.print_tables:
                sinks.print_plan(report)
            if self.settings.trackers:
                sinks.to_wandb(report.to_dict(), summary=False)
            self._write(args)
        self.clock.start()
        self.run_clock.start()  # set-up ends: the training loop starts

    @_never_breaks_training()
    def on_step_begin(self, args, state, control, **kwargs):
        if self.active:
            self.memory.step_begin(state)
            self.run_clock.enter("steps")

    def _compile_opened_after(self) -> int:
        """The step after which ``compile.when: pays_back`` let the blocks compile (-2: not in this run)."""
        outcome = (getattr(self.trainer, "speedup_outcomes", None) or {}).get("compile")
        return outcome.facts.get(OPENED_AFTER_STEP, -2) if outcome is not None else -2

    @_never_breaks_training()
    def on_step_end(self, args, state, control, **kwargs):
        if not self.active:
            return
        self.run_clock.leave("steps")
        tracked = self.memory.step_end()  # a step under MemTracker: slower, left out of the steady state
        self.clock.step_end(state.global_step, tracked, self._compile_opened_after)
        self.run_clock.mark()  # a save of this step is timed from here

    @_never_breaks_training()
    def on_log(self, args, state, control, **kwargs):
        if self.active:
            self.run_clock.mark()  # the log before a save is not the save

    @_never_breaks_training()
    def on_epoch_end(self, args, state, control, **kwargs):
        if self.active:
            self.run_clock.mark()

    @_never_breaks_training()
    def carry_into(self, checkpoint: str) -> None:
        """What a resume from ``checkpoint`` carries over, written into it. ``crash_safe`` calls it on the staging
        folder before the rename, so a checkpoint in place always has its counters; otherwise ``on_save`` does,
        into the folder the Trainer has just written. Every process must call it (one collective)."""
        if not self.active:
            return
        # the time split up to now, the save under way included (crash_safe calls this inside its save)
        totals = self._totals(self._gather(), bounded=True, split=self.run_clock.split(saving=True))
        self._carried_at = self.trainer.state.global_step
        if self.trainer.state.is_world_process_zero and os.path.isdir(checkpoint) and self.settings.path is not None:
            carry.write(totals, checkpoint)

    @_never_breaks_training()
    def on_save(self, args, state, control, **kwargs):
        if not self.active:
            return
        self.run_clock.saved()  # the Trainer's _save_checkpoint has just returned: blocked since the last mark
        if self._carried_at != state.global_step:  # not yet written into the checkpoint
            self.carry_into(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        if state.is_world_process_zero:
            self._write(args)

    @_never_breaks_training()
    def on_train_end(self, args, state, control, **kwargs):
        if not self.active:
            return
        if not self.finalized:
            self.finalize()
        self.trainer.verify_speedup()  # engagement as it stands at the end (e.g. compiled code really ran)
        self.active = False
        if state.is_world_process_zero:
            report = self.trainer.speedup_report
            path = self._write(args)
            if self.settings.trackers:
                sinks.to_wandb(report.to_dict(), summary=True)
            if self.print_tables:
                sinks.print_metrics(report, path)

    def _write(self, args):
        """The JSON report where ``report.path`` says (None: not written)."""
        path = sinks.report_file(self.settings.path, args.output_dir)
        return sinks.write_json(self.trainer.speedup_report, path) if path is not None else None

