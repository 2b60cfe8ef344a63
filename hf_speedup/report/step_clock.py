"""The collector's clock: each optimizer step's host wall time and the steps that are warm-up.

A step lasts from one ``on_step_end`` to the next (data loading included; no device synchronisation). The first
step, every step during which dynamo compiled something and a step run under MemTracker are warm-up: left out of
the steady-state figures, counted in the whole-run ones. Kept apart from the collector's hooks so that what a
step's time means is stated in one place.
"""

from __future__ import annotations

import time
from array import array
from typing import Callable

from . import measure as M


class StepClock:
    """Step times of one ``train()`` run, its warm-up steps and dynamo's counters since it started."""

    def __init__(self, max_step_times: int) -> None:
        self.times = array("d")
        self.warmup: set[int] = set()  # indices into times
        self.warmup_global: list[int] = []  # the same steps as global step numbers
        self.series = M.BoundedSeries(max_step_times)  # [global step, seconds, compiled] per step, thinned
        self.dynamo_start = M.dynamo_snapshot()
        self.events = M.compile_events()
        # the cold compile: step 1's, or that of the step after compile.when = pays_back opened the gate
        self.first_step_compile_seconds: float | None = None
        self.t_begin = self.t_last = time.perf_counter()

    def start(self) -> None:
        """Training starts now: the first step is timed from here."""
        self.t_begin = self.t_last = time.perf_counter()

    def compile_diff(self) -> dict:
        """Dynamo's counters since this run started (compile seconds, frames, recompiles, graph breaks)."""
        return M.dynamo_diff(self.dynamo_start, M.dynamo_snapshot())

    def steady(self, start: int = 0) -> list[float]:
        """Step times from index ``start`` on, warm-up steps left out."""
        return [t for i, t in enumerate(self.times[start:], start) if i not in self.warmup]

    def step_end(self, global_step: int, tracked: bool, compile_opened_after: Callable[[], int]) -> None:
        """One optimizer step ended: its time; warm-up if ``tracked`` (MemTracker), the first, or it compiled.
        ``compile_opened_after()``: the step after which ``compile.when: pays_back`` opened the gate."""
        now = time.perf_counter()
        idx = len(self.times)
        self.times.append(now - self.t_last)
        self.t_last = now
        if tracked:
            self.warmup.add(idx)
        if idx == 0 or global_step == compile_opened_after() + 1:  # the cold compile's step
            self.first_step_compile_seconds = self.compile_diff()["compile_seconds"]
        events = M.compile_events()
        compiled = events != self.events
        if compiled or idx == 0:
            self.warmup.add(idx)
            self.events = events
            if len(self.warmup_global) < 64:
                self.warmup_global.append(global_step)
        self.series.append([global_step, round(self.times[idx], 6), bool(compiled)])
