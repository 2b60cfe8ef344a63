"""The report's history: at each training log, the figures of the steps since the previous log (a window), in
the steady state as the summary measures it, beside the whole run's so far. These are also the ``hf_speedup/*``
metrics the trackers get with that log."""

from __future__ import annotations

import statistics
import time

from . import measure as M
from .model_facts import ModelFacts
from .step_clock import StepClock


class LogWindows:
    """One entry per training log, kept in a bounded series (the report's ``history``)."""

    def __init__(self, max_history: int) -> None:
        self.history = M.BoundedSeries(max_history)
        self.last_log = {**{k: 0 for k in M.COUNTS}, "index": 0}  # the counts and step index at the last log
        self.last_logged_step = -1

    def due(self, step: int, clock: StepClock) -> bool:
        """A new window: a global step not logged yet, with steps timed since the last one."""
        return step != self.last_logged_step and len(clock.times) > self.last_log["index"]

    def close(self, agg: dict, clock: StepClock, facts: ModelFacts, devices: int, step: int) -> dict:
        """The window ending now, from ``agg`` (every rank's counts so far), into the history."""
        start = self.last_log["index"]
        deltas = list(clock.times[start:])
        # steady state, as the summary: the window's steps at its median step time, the steps that compiled
        # left out (none left: no steady figure; the whole-run one below still has the wall clock)
        steady = clock.steady(start)
        step_time = float(statistics.median(steady)) if steady else None
        wall = len(deltas) * step_time if step_time else 0.0
        tokens = agg["tokens"] - self.last_log["tokens"]
        samples = agg["samples"] - self.last_log["samples"]
        tps = tokens / wall if wall > 0 and tokens else None
        fpt = facts.flops_per_token(*(agg[k] - self.last_log[k] for k in M.COUNTS[2:]))
        achieved = M.model_flops_per_second(tps, fpt)
        dyn = clock.compile_diff()
        elapsed = sum(clock.times)
        entry = {
            "step": step,
            "time_s": round(time.perf_counter() - clock.t_begin, 4),
            "steps": len(deltas),
            "tokens_per_second": tps,
            "samples_per_second": samples / wall if wall > 0 and samples else None,
            "step_time_s": step_time,
            "mfu": M.mfu(tps, fpt, facts.peak_flops, devices),
            "model_flops_per_second": achieved,
            "fraction_of_matmul_peak": M.fraction_of_peak(achieved, facts.matmul_peak, devices),
            "peak_memory_allocated_bytes": agg["peak_memory_allocated_bytes"],
            "peak_memory_reserved_bytes": agg["peak_memory_reserved_bytes"],
            "memory_allocated_bytes": agg["memory_allocated_bytes"],
            "recompiles": dyn["recompiles"],
            "compiled_steps": sum(1 for i in range(start, len(clock.times)) if i in clock.warmup),
            # since the first step, wall clock (compiles included), and the compile seconds so far
            "whole_run_tokens_per_second": agg["tokens"] / elapsed if elapsed > 0 and agg["tokens"] else None,
            "compile_seconds": round(dyn["compile_seconds"], 6),
        }
        self.last_log = {**{k: agg[k] for k in M.COUNTS}, "index": len(clock.times)}
        self.history.append(entry)
        return entry
