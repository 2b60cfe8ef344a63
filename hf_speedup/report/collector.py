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
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import statistics
import time
from array import array

from transformers import TrainerCallback

from ..features.compile.payback import OPENED_AFTER_STEP
from ..model_info import ParamCounts, parameter_counts
from ..peak_flops import resolve_peak_flops
from . import carry
from . import measure as M
from . import sinks
from .schema import PREFIX, STEP_METRICS, SUMMARY_METRICS, Metrics

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
        self.params: ParamCounts | None = None
        self.layers = self.attention_width = None
        self._describe_model()  # now, before accelerate/FSDP wraps or shards it
        self._resolve_peak()  # a malformed HF_SPEEDUP_PEAK_FLOPS fails here, before training
        self.active = False
        self.finalized = False
        self._carried_at: int | None = None  # the step whose checkpoint has the counters (carry_into)

    # ------------------------------------------------------------------------------------ set-up
    def _describe_model(self) -> None:
        model = self.trainer.model
        if model is not None and self.params is None:
            self.params = parameter_counts(model)
            self.layers, self.attention_width = M.attention_dims(model)

    def _resolve_peak(self) -> None:
        caps = self.trainer.speedup_plan.caps
        device_type = getattr(getattr(self.trainer.args, "device", None), "type", caps.device_type)
        self.device_type = device_type
        self.dtype = M.compute_dtype(self.trainer.args, self.trainer.model, device_type)
        self.peak_flops, self.peak_source = resolve_peak_flops(device_type, caps.device_name, self.dtype)

    def _num_devices(self) -> int:
        acc = getattr(self.trainer, "accelerator", None)
        procs = int(getattr(acc, "num_processes", 1) or 1)
        n_gpu = int(getattr(self.trainer.args, "n_gpu", 1) or 1)
        return procs * (n_gpu if procs == 1 and n_gpu > 1 else 1)

    def _reset(self, args) -> None:
        if self.settings.trackers:
            sinks.route_wandb_metrics(self.trainer.callback_handler.callbacks)
        self.counter.reset()
        self.active = True
        self.finalized = False
        self.step_times = array("d")
        self.warmup: set[int] = set()  # indices into step_times
        self.warmup_global: list[int] = []  # the same steps as global step numbers
        self.step_series = M.BoundedSeries(self.max_step_times)
        self.history = M.BoundedSeries(self.max_history)
        self.last_log = {**{k: 0 for k in M.COUNTS}, "index": 0}
        self.last_logged_step = -1
        self.dynamo_start = M.dynamo_snapshot()
        self.events = M.compile_events()
        # the cold compile: step 1's, or that of the step after compile.when = pays_back opened the gate
        self.first_step_compile_seconds: float | None = None
        self.t_begin = self.t_last = time.perf_counter()
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
            if step != self.last_logged_step and len(self.step_times) > self.last_log["index"]:
                self.last_logged_step = step
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

        mem = M.memory_snapshot(self.device_type, getattr(self.trainer.args, "device", None))
        acc = getattr(self.trainer, "accelerator", None)
        if acc is not None and getattr(acc, "num_processes", 1) > 1:
            device = self.trainer.args.device
            memory = torch.tensor([mem[k] for k in M.RANK_FIELDS[len(M.COUNTS):]], dtype=torch.int64, device=device)
            row = torch.cat([self.counter.totals_tensor(device).to(torch.int64), memory])
            rows = acc.gather(row.unsqueeze(0)).reshape(-1, len(M.RANK_FIELDS)).tolist()
        else:
            rows = [[*self.counter.totals_tensor().tolist(), *[mem[k] for k in M.RANK_FIELDS[len(M.COUNTS):]]]]
        return M.aggregate_ranks(rows)

    def _flops_per_token(self, attended_tokens: int, attended_squares: int) -> float | None:
        seq_len = M.attention_length(attended_tokens, attended_squares)
        if seq_len is None or self.params is None:
            return None
        return M.flops_per_token(self.params.matmul_trainable, self.params.matmul_frozen, self.layers,
                                 self.attention_width, seq_len)

    def _window(self) -> dict:
        agg = self._gather()
        start = self.last_log["index"]
        deltas = list(self.step_times[start:])
        # steady state, as the summary: the window's steps at its median step time, the steps that compiled
        # left out (none left: no steady figure; the whole-run one below still has the wall clock)
        steady = [d for i, d in enumerate(deltas, start) if i not in self.warmup]
        step_time = float(statistics.median(steady)) if steady else None
        wall = len(deltas) * step_time if step_time else 0.0
        tokens = agg["tokens"] - self.last_log["tokens"]
        samples = agg["samples"] - self.last_log["samples"]
        tps = tokens / wall if wall > 0 and tokens else None
        dyn = M.dynamo_diff(self.dynamo_start, M.dynamo_snapshot())
        elapsed = sum(self.step_times)
        entry = {
            "step": self.trainer.state.global_step,
            "time_s": round(time.perf_counter() - self.t_begin, 4),
            "steps": len(deltas),
            "tokens_per_second": tps,
            "samples_per_second": samples / wall if wall > 0 and samples else None,
            "step_time_s": step_time,
            "mfu": M.mfu(tps, self._flops_per_token(*(agg[k] - self.last_log[k] for k in M.COUNTS[2:])),
                         self.peak_flops, self._num_devices()),
            "peak_memory_allocated_bytes": agg["peak_memory_allocated_bytes"],
            "peak_memory_reserved_bytes": agg["peak_memory_reserved_bytes"],
            "memory_allocated_bytes": agg["memory_allocated_bytes"],
            "recompiles": dyn["recompiles"],
            "compiled_steps": sum(1 for i in range(start, len(self.step_times)) if i in self.warmup),
            # since the first step, wall clock (compiles included), and the compile seconds so far
            "whole_run_tokens_per_second": agg["tokens"] / elapsed if elapsed > 0 and agg["tokens"] else None,
            "compile_seconds": round(dyn["compile_seconds"], 6),
        }
        self.last_log = {**{k: agg[k] for k in M.COUNTS}, "index": len(self.step_times)}
        self.history.append(entry)
        return entry

    def _totals(self, agg: dict, bounded: bool = False) -> carry.Carried:
        """This run's counts plus those carried over from the checkpoint it resumed from (``bounded``: the
        lists thinned to the collector's limits, as written into a checkpoint)."""
        c = self.carried
        dyn = M.dynamo_diff(self.dynamo_start, M.dynamo_snapshot())
        first = self.first_step_compile_seconds  # the cold compile; what came after it is recompiling
        recompiled = max(0.0, dyn["compile_seconds"] - first) if first is not None else 0.0
        steady = c.steady_step_times + [t for i, t in enumerate(self.step_times) if i not in self.warmup]
        history, series = c.history + list(self.history.items), c.step_times + list(self.step_series.items)
        if bounded:
            steady = _thin(steady, self.max_step_times)
        return carry.Carried(
            global_step=self.trainer.state.global_step, segments=c.segments + 1,
            steps=c.steps + len(self.step_times), warmup_steps=c.warmup_steps + len(self.warmup),
            tokens=c.tokens + agg["tokens"], samples=c.samples + agg["samples"],
            attended_tokens=c.attended_tokens + agg["attended_tokens"],
            attended_squares=c.attended_squares + agg["attended_squares"],
            wall_seconds=c.wall_seconds + (time.perf_counter() - self.t_begin),
            compile_seconds=c.compile_seconds + dyn["compile_seconds"], recompiles=c.recompiles + dyn["recompiles"],
            recompile_seconds=round(c.recompile_seconds + recompiled, 6),
            graph_breaks=c.graph_breaks + dyn["graph_breaks"], dynamo_frames=c.dynamo_frames + dyn["frames"],
            warmup_global_steps=(c.warmup_global_steps + self.warmup_global)[:64], steady_step_times=steady,
            history=_thin(history, self.max_history), step_times=_thin(series, self.max_step_times))

    def finalize(self) -> Metrics:
        """Steady-state summary of the run into ``trainer.speedup_report`` (every process calls it)."""
        agg = self._gather()
        total = self._totals(agg)  # a resumed run: the whole run, counts carried from its checkpoint
        steps = total.steps
        if total.steady_step_times:
            step_time, steady = float(statistics.median(total.steady_step_times)), total.steps - total.warmup_steps
        else:
            step_time, steady = M.steady_state_step_time(self.step_times, self.warmup)
        tokens, samples = total.tokens, total.samples
        # none counted (batches without token tensors, e.g. GRPO's raw prompts): unknown, not zero
        tps = (tokens / steps) / step_time if steps and step_time and tokens else None
        sps = (samples / steps) / step_time if steps and step_time and samples else None
        fpt = self._flops_per_token(total.attended_tokens, total.attended_squares)
        devices = self._num_devices()
        trainer = self.trainer
        params = self.params or ParamCounts(0, 0, 0, 0, 0)
        wall = total.wall_seconds
        metrics = Metrics(**{
            "tokens_per_second": tps,
            "samples_per_second": sps,
            "step_time_s": step_time,
            "whole_run_tokens_per_second": tokens / wall if wall and tokens else None,
            "whole_run_samples_per_second": samples / wall if wall and samples else None,
            "whole_run_seconds": round(wall, 4) if wall else None,
            "mfu": M.mfu(tps, fpt, self.peak_flops, devices),
            "peak_memory_allocated_bytes": agg["peak_memory_allocated_bytes"],
            "peak_memory_reserved_bytes": agg["peak_memory_reserved_bytes"],
            "compile_seconds": round(total.compile_seconds, 6),
            "recompile_seconds": total.recompile_seconds if self.first_step_compile_seconds is not None else None,
            "recompiles": total.recompiles,
            "graph_breaks": total.graph_breaks,
            "compiled_regions": M.compiled_regions(getattr(trainer, "model_wrapped", None), trainer.model),
            "trainable_parameters": params.trainable,
            "total_parameters": params.total,
        })
        metrics.estimated_peak_bytes, memory = self.memory.summary(tokens, int(getattr(trainer.args,
                                                                  "gradient_accumulation_steps", 1) or 1),
                                                                  self.device_type)
        measurement = {
            "steps": steps,
            "steady_state_steps": steady,
            "warmup_steps": total.warmup_steps,
            "warmup_global_steps": total.warmup_global_steps,  # the first 64
            "step_time_statistic": "median of steady-state steps (first step and steps that compiled excluded)",
            "tokens": tokens,
            "samples": samples,
            "tokens_note": None if tokens or not steps else (
                "no token counted: the batches the trainer stepped on carried no input_ids, attention_mask, "
                "position_ids or labels tensors (e.g. GRPO's raw prompts), so throughput and MFU are unknown"),
            "mean_sequence_length": tokens / samples if samples else None,
            "attention_sequence_length": M.attention_length(total.attended_tokens, total.attended_squares),
            "flops_per_token": fpt,
            "flops_formula": ("4*N_frozen + 6*N_trainable + 12*L*H*S (non-embedding matmul weights; S = "
                              "attention_sequence_length = sum(L_i^2)/sum(L_i) over sequences; recomputation not "
                              "counted)"),
            "matmul_parameters_trainable": params.matmul_trainable,
            "matmul_parameters_frozen": params.matmul_frozen,
            "embedding_parameters": params.embedding,
            "num_layers": self.layers,
            "attention_width": self.attention_width,
            "compute_dtype": self.dtype,
            "peak_flops_per_device": self.peak_flops,
            "peak_flops_source": self.peak_source,
            "num_devices": devices,
            "memory_source": M.memory_source(self.device_type),
            "wall_seconds": round(total.wall_seconds, 4),
            "dynamo_frames": total.dynamo_frames,
            "train_runs": total.segments,  # > 1: resumed; the counts above cover every run since step 0
            "resumed_from": self.resumed_from,
            "resume_counters": self.carry_note,
            **memory,
        }
        report = trainer.speedup_report
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
        self._describe_model()  # a model made by ``model_init`` inside ``train()``
        self.trainer.verify_speedup()
        self._resolve_peak()
        M.reset_peak_memory(self.device_type, getattr(args, "device", None))
        report = self.trainer.speedup_report
        report.environment = M.environment(self.trainer.speedup_plan.caps)
        report.environment["world_size"] = self._num_devices()
        report.metrics, report.measurement, report.history, report.step_times = Metrics(), {}, [], []
        if state.is_world_process_zero:
            if self.print_tables:
                sinks.print_plan(report)
            if self.settings.trackers:
                sinks.to_wandb(report.to_dict(), summary=False)
            self._write(args)
        self.t_begin = self.t_last = time.perf_counter()

    @_never_breaks_training()
    def on_step_begin(self, args, state, control, **kwargs):
        if self.active:
            self.memory.step_begin(state)

    def _compile_opened_after(self) -> int:
        """The step after which ``compile.when: pays_back`` let the blocks compile (-2: not in this run)."""
        outcome = (getattr(self.trainer, "speedup_outcomes", None) or {}).get("compile")
        return outcome.facts.get(OPENED_AFTER_STEP, -2) if outcome is not None else -2

    @_never_breaks_training()
    def on_step_end(self, args, state, control, **kwargs):
        if not self.active:
            return
        tracked = self.memory.step_end()  # a step under MemTracker: slower, left out of the steady state
        now = time.perf_counter()
        idx = len(self.step_times)
        self.step_times.append(now - self.t_last)
        self.t_last = now
        if tracked:
            self.warmup.add(idx)
        if idx == 0 or state.global_step == self._compile_opened_after() + 1:  # the cold compile's step
            self.first_step_compile_seconds = M.dynamo_diff(self.dynamo_start, M.dynamo_snapshot())["compile_seconds"]
        events = M.compile_events()
        compiled = events != self.events
        if compiled or idx == 0:
            self.warmup.add(idx)
            self.events = events
            if len(self.warmup_global) < 64:
                self.warmup_global.append(state.global_step)
        self.step_series.append([state.global_step, round(self.step_times[idx], 6), bool(compiled)])

    @_never_breaks_training()
    def carry_into(self, checkpoint: str) -> None:
        """What a resume from ``checkpoint`` carries over, written into it. ``crash_safe`` calls it on the staging
        folder before the rename, so a checkpoint in place always has its counters; otherwise ``on_save`` does,
        into the folder the Trainer has just written. Every process must call it (one collective)."""
        if not self.active:
            return
        totals = self._totals(self._gather(), bounded=True)
        self._carried_at = self.trainer.state.global_step
        if self.trainer.state.is_world_process_zero and os.path.isdir(checkpoint) and self.settings.path is not None:
            carry.write(totals, checkpoint)

    @_never_breaks_training()
    def on_save(self, args, state, control, **kwargs):
        if not self.active:
            return
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


def _thin(items: list, limit: int) -> list:
    """At most ``limit`` items spread over the whole series (first kept), as :class:`~.measure.BoundedSeries` does."""
    while len(items) > max(2, limit):
        items = items[::2]
    return items
