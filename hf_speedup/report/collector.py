"""The collector: a TrainerCallback that verifies the plan, measures the run and hands the report to the sinks.

How it measures without adding device synchronisation:

- tokens: :class:`SpeedupTrainer.training_step` hands every micro-batch to :meth:`count_batch`, which
  sums ``attention_mask`` *on the device* (no ``.item()``);
- time: host clock at each ``on_step_end`` (step-to-step wall time, data loading included);
- at a logging step the Trainer has just synchronised (it reads the loss with ``.item()``); only then
  are the token counts read and, in multi-process runs, gathered in one small collective (tokens and
  samples summed over ranks, memory maxed);
- memory: allocator statistics (host-side queries); compile: dynamo's counters (host-side).

Per logging step the metrics go through ``Trainer.log`` (so every ``report_to`` tracker and
``state.log_history`` get them) as ``hf_speedup/<metric>`` — trackers that prefix training logs show
them as ``train/hf_speedup/<metric>``. At the end the steady-state summary is logged the same way, put
into the W&B run summary as ``hf_speedup/<metric>`` (the plan goes to the W&B config as
``hf_speedup/<feature>/<field>``), written to ``<output_dir>/speedup_report.json`` and printed.
Only the main process prints and writes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from array import array

from transformers import TrainerCallback

from ..model_info import ParamCounts, parameter_counts
from ..peak_flops import resolve_peak_flops
from . import measure as M
from . import sinks
from .schema import PREFIX, STEP_METRICS, SUMMARY_METRICS, Metrics

logger = logging.getLogger("hf_speedup")


class SpeedupCallback(TrainerCallback):
    """Created by :class:`~hf_speedup.trainer.SpeedupTrainer`; ``trainer`` is that trainer."""

    def __init__(self, trainer, *, print_tables: bool = True, max_history: int = 1024,
                 max_step_times: int = 4096) -> None:
        self.trainer = trainer
        self.print_tables = print_tables
        self.max_history = max_history
        self.max_step_times = max_step_times
        self.counter = M.TokenCounter()
        self.params: ParamCounts | None = None
        self.layers = self.attention_width = None
        self._describe_model()  # now, before accelerate/FSDP wraps or shards it
        self._resolve_peak()  # a malformed HF_SPEEDUP_PEAK_FLOPS fails here, before training
        self.active = False
        self.finalized = False

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
        self.counter.reset()
        self.active = True
        self.finalized = False
        self.step_times = array("d")
        self.warmup: set[int] = set()  # indices into step_times
        self.warmup_global: list[int] = []  # the same steps as global step numbers
        self.step_series = M.BoundedSeries(self.max_step_times)
        self.history = M.BoundedSeries(self.max_history)
        self.last_log = {"tokens": 0, "samples": 0, "index": 0}
        self.last_logged_step = -1
        self.dynamo_start = M.dynamo_snapshot()
        self.events = M.compile_events()
        self.t_begin = self.t_last = time.perf_counter()

    # ------------------------------------------------------------------- hooks from the trainer
    def count_batch(self, inputs) -> None:
        """Called by ``SpeedupTrainer.training_step`` for every micro-batch (device-side sum, no sync)."""
        if self.active:
            self.counter.add(inputs)

    def augment_logs(self, logs: dict) -> dict:
        """Called by ``SpeedupTrainer.log`` on every process: adds ``hf_speedup/*`` to training logs."""
        if not self.active or not isinstance(logs, dict):
            return logs
        if "train_runtime" in logs:  # the Trainer's end-of-training log
            if not self.finalized:
                self.finalize()
            logs.update(self._log_values(dataclasses.asdict(self.trainer.speedup_report.metrics), SUMMARY_METRICS))
        elif "loss" in logs and not any(k.startswith(("eval_", "test_")) for k in logs):
            step = self.trainer.state.global_step
            if step != self.last_logged_step and len(self.step_times) > self.last_log["index"]:
                self.last_logged_step = step
                logs.update(self._log_values(self._window(), STEP_METRICS))
        return logs

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
            row = torch.stack([self.counter.tokens_tensor(device).to(torch.int64).reshape(()),
                               torch.tensor(self.counter.samples, dtype=torch.int64, device=device),
                               *[torch.tensor(mem[k], dtype=torch.int64, device=device) for k in M.RANK_FIELDS[2:]]])
            rows = acc.gather(row.unsqueeze(0)).reshape(-1, len(M.RANK_FIELDS)).tolist()
        else:
            rows = [[int(self.counter.tokens_tensor()), self.counter.samples, *[mem[k] for k in M.RANK_FIELDS[2:]]]]
        return M.aggregate_ranks(rows)

    def _flops_per_token(self, tokens: int, samples: int) -> float | None:
        if not tokens or not samples or self.params is None:
            return None
        return M.flops_per_token(self.params.matmul_trainable, self.params.matmul_frozen, self.layers,
                                 self.attention_width, tokens / samples)

    def _window(self) -> dict:
        agg = self._gather()
        start = self.last_log["index"]
        deltas = list(self.step_times[start:])
        wall = sum(deltas)
        tokens = agg["tokens"] - self.last_log["tokens"]
        samples = agg["samples"] - self.last_log["samples"]
        tps = tokens / wall if wall > 0 else None
        entry = {
            "step": self.trainer.state.global_step,
            "time_s": round(time.perf_counter() - self.t_begin, 4),
            "steps": len(deltas),
            "tokens_per_second": tps,
            "samples_per_second": samples / wall if wall > 0 else None,
            "step_time_s": float(statistics.median(deltas)) if deltas else None,
            "mfu": M.mfu(tps, self._flops_per_token(tokens, samples), self.peak_flops, self._num_devices()),
            "peak_memory_allocated_bytes": agg["peak_memory_allocated_bytes"],
            "peak_memory_reserved_bytes": agg["peak_memory_reserved_bytes"],
            "memory_allocated_bytes": agg["memory_allocated_bytes"],
            "recompiles": M.dynamo_diff(self.dynamo_start, M.dynamo_snapshot())["recompiles"],
            "compiled_steps": sum(1 for i in range(start, len(self.step_times)) if i in self.warmup),
        }
        self.last_log = {"tokens": agg["tokens"], "samples": agg["samples"], "index": len(self.step_times)}
        self.history.append(entry)
        return entry

    def finalize(self) -> Metrics:
        """Steady-state summary of the run into ``trainer.speedup_report`` (every process calls it)."""
        agg = self._gather()
        steps = len(self.step_times)
        step_time, steady = M.steady_state_step_time(self.step_times, self.warmup)
        tokens, samples = agg["tokens"], agg["samples"]
        tps = (tokens / steps) / step_time if steps and step_time else None
        sps = (samples / steps) / step_time if steps and step_time else None
        fpt = self._flops_per_token(tokens, samples)
        devices = self._num_devices()
        dyn = M.dynamo_diff(self.dynamo_start, M.dynamo_snapshot())
        trainer = self.trainer
        params = self.params or ParamCounts(0, 0, 0, 0, 0)
        metrics = Metrics(**{
            "tokens_per_second": tps,
            "samples_per_second": sps,
            "step_time_s": step_time,
            "mfu": M.mfu(tps, fpt, self.peak_flops, devices),
            "peak_memory_allocated_bytes": agg["peak_memory_allocated_bytes"],
            "peak_memory_reserved_bytes": agg["peak_memory_reserved_bytes"],
            "compile_seconds": round(dyn["compile_seconds"], 6),
            "recompiles": dyn["recompiles"],
            "graph_breaks": dyn["graph_breaks"],
            "compiled_regions": M.compiled_regions(getattr(trainer, "model_wrapped", None), trainer.model),
            "trainable_parameters": params.trainable,
            "total_parameters": params.total,
        })
        measurement = {
            "steps": steps,
            "steady_state_steps": steady,
            "warmup_steps": len(self.warmup),
            "warmup_global_steps": list(self.warmup_global),  # the first 64
            "step_time_statistic": "median of steady-state steps (first step and steps that compiled excluded)",
            "tokens": tokens,
            "samples": samples,
            "mean_sequence_length": tokens / samples if samples else None,
            "flops_per_token": fpt,
            "flops_formula": ("4*N_frozen + 6*N_trainable + 12*L*H*S (non-embedding matmul weights; "
                              "recomputation not counted)"),
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
            "wall_seconds": round(time.perf_counter() - self.t_begin, 4),
            "dynamo_frames": dyn["frames"],
        }
        report = trainer.speedup_report
        report.metrics = metrics
        report.measurement = measurement
        report.history = list(self.history.items)
        report.step_times = list(self.step_series.items)
        self.finalized = True
        return metrics

    # ------------------------------------------------------------------------------ callbacks
    def on_train_begin(self, args, state, control, **kwargs):
        self._reset(args)
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
            sinks.to_wandb(report.to_dict(), summary=False)
            sinks.write_json(report, args.output_dir)
        self.t_begin = self.t_last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if not self.active:
            return
        now = time.perf_counter()
        idx = len(self.step_times)
        self.step_times.append(now - self.t_last)
        self.t_last = now
        events = M.compile_events()
        compiled = events != self.events
        if compiled or idx == 0:
            self.warmup.add(idx)
            self.events = events
            if len(self.warmup_global) < 64:
                self.warmup_global.append(state.global_step)
        self.step_series.append([state.global_step, round(self.step_times[idx], 6), bool(compiled)])

    def on_save(self, args, state, control, **kwargs):
        if self.active and state.is_world_process_zero:
            sinks.write_json(self.trainer.speedup_report, args.output_dir)

    def on_train_end(self, args, state, control, **kwargs):
        if not self.active:
            return
        if not self.finalized:
            self.finalize()
        self.trainer.verify_speedup()  # engagement as it stands at the end (e.g. compiled code really ran)
        self.active = False
        if state.is_world_process_zero:
            report = self.trainer.speedup_report
            path = sinks.write_json(report, args.output_dir)
            sinks.to_wandb(report.to_dict(), summary=True)
            if self.print_tables:
                sinks.print_metrics(report, path)
