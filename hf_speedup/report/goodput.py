"""Goodput: where the whole run's wall clock went, and the share of it that trained.

A run is judged by its wall clock, not its best step. The main thread's wall clock, from the process's start to
the end of training, is split into parts that sum to it exactly:

- ``setup``: process start (``psutil``'s create time of the process; for a later ``train()`` in the same process,
  the end of the previous one) to the start of the training loop (the end of ``on_train_begin``): imports, model,
  trainer, plan, checkpoint loading;
- ``compile``: dynamo's compile seconds (frames and lazily compiled backward graphs, backend included) during the
  loop, wherever they fell (a step, an evaluation);
- ``steps``: productive step time, ``on_step_begin`` to ``on_step_end`` of every optimizer step (forward, backward,
  optimizer), less the compiling inside it;
- ``save``: blocked by saves, from the last event before a checkpoint (the step's end, its log, its evaluation) to
  the end of the Trainer's ``on_save`` callbacks: ``_save_checkpoint`` with any wait for a previous asynchronous
  save still in flight;
- ``eval``: inside ``evaluate`` during training;
- ``data``: inside the Trainer's ``get_batch_samples`` (the data loader's ``next`` for every micro-batch of a step);
- ``other``: the rest (logging with its device synchronisation, callbacks, epoch boundaries).

``goodput = steps / wall``. Host clock only, no device synchronisation: on a GPU a part absorbs the device work the
host waits for inside it (a batch's copy to the device waits for the previous step's kernels; a log's loss read
waits for the step).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

from .measure import compile_seconds

PARTS = ("setup", "compile", "steps", "save", "eval", "data", "other")  # they sum to ``wall_seconds``
PHASES = ("steps", "save", "eval", "data")  # timed on the main thread; compile inside them is moved to "compile"
DATA_WAIT, EVALUATION = "data", "eval"  # the phases the trainer's get_batch_samples and evaluate are timed as

_IMPORTED = time.time()
_last_run_end: float | None = None  # perf_counter() when the previous train() of this process stopped its clock


def process_start() -> tuple[float, str]:
    """(the process's start as ``time.time()``, where it comes from)."""
    try:
        import psutil

        return float(psutil.Process().create_time()), "process start (psutil create_time)"
    except Exception:  # pragma: no cover - psutil is a dependency; a sandbox may hide /proc
        return _IMPORTED, "hf_speedup import (the process's start time is unreadable here)"


def run_origin() -> tuple[float, str]:
    """Where a ``train()`` starting now begins its wall clock, as ``perf_counter()``, and what that instant is."""
    if _last_run_end is not None:
        return _last_run_end, "end of the previous train() in this process"
    start, source = process_start()
    return time.perf_counter() - max(0.0, time.time() - start), source


class PhaseClock:
    """Main-thread wall time by phase. Phases nest (an inner one pauses the outer one, so no second counts twice);
    dynamo's compile seconds inside a phase are taken out of it and counted apart. ``save`` is timed back from
    :meth:`saved` to the last :meth:`mark` (the Trainer has no hook before a save)."""

    def __init__(self, phases=PHASES) -> None:
        self.net = dict.fromkeys(phases, 0.0)
        self.compiled = 0.0  # compile seconds that fell inside timed phases
        self.stack: list[list] = []  # [phase, since (perf_counter), compile seconds then]
        self.mark_at: tuple[float, float] | None = None

    @staticmethod
    def now() -> tuple[float, float]:
        return time.perf_counter(), compile_seconds()

    def _accrue(self, net: dict, phase: str, since: tuple[float, float], now: tuple[float, float]) -> float:
        """Into ``net[phase]`` the time from ``since`` to ``now`` less its compiling; returns the compiling."""
        dt = max(0.0, now[0] - since[0])
        dc = min(dt, max(0.0, now[1] - since[1]))
        net[phase] = net.get(phase, 0.0) + dt - dc
        return dc

    def enter(self, phase: str) -> None:
        now = self.now()
        if self.stack:  # pause the phase it interrupts
            top = self.stack[-1]
            self.compiled += self._accrue(self.net, top[0], top[1], now)
            top[1] = now
        self.stack.append([phase, now])

    def leave(self, phase: str) -> None:
        if not self.stack or self.stack[-1][0] != phase:
            return  # unmatched (an exception unwound past it): nothing to close
        now = self.now()
        name, since = self.stack.pop()
        self.compiled += self._accrue(self.net, name, since, now)
        if self.stack:
            self.stack[-1][1] = now
        else:
            self.mark_at = now

    @contextmanager
    def phase(self, phase: str) -> Iterator[None]:
        self.enter(phase)
        try:
            yield
        finally:
            self.leave(phase)

    def mark(self) -> None:
        """The last event before a possible save (a step's end, a log)."""
        if not self.stack:
            self.mark_at = self.now()

    def saved(self) -> None:
        """A save has just ended (``on_save``): the time since the last mark was spent in it."""
        if self.stack or self.mark_at is None:
            return
        now = self.now()
        self.compiled += self._accrue(self.net, "save", self.mark_at, now)
        self.mark_at = now

    def totals(self, now: tuple[float, float], saving: bool = False) -> tuple[dict, float]:
        """(net seconds per phase, compile seconds inside phases) up to ``now``, the running phase included;
        ``saving``: a save is under way since the last mark (its time so far counts)."""
        net, compiled = dict(self.net), self.compiled
        if self.stack:
            compiled += self._accrue(net, self.stack[-1][0], self.stack[-1][1], now)
        elif saving and self.mark_at is not None:
            compiled += self._accrue(net, "save", self.mark_at, now)
        return net, compiled


class RunClock(PhaseClock):
    """One ``train()``'s wall clock in :data:`PARTS`."""

    def __init__(self) -> None:
        super().__init__()
        self.origin, self.origin_source = run_origin()
        self.loop_start: tuple[float, float] | None = None
        self.closed = False

    def start(self) -> None:
        """The training loop starts now: set-up ends."""
        self.loop_start = self.mark_at = self.now()

    def split(self, saving: bool = False) -> dict:
        """The parts up to now (seconds, summing to ``wall_seconds``); ``saving``: called during a save."""
        now = self.now()
        start = self.loop_start or now
        net, compiled = self.totals(now, saving)
        loop = max(0.0, now[0] - start[0])
        rest = max(0.0, loop - sum(net.values()) - compiled)
        rest_compile = min(rest, max(0.0, now[1] - start[1] - compiled))  # compiling outside the timed phases
        parts = {"setup": max(0.0, start[0] - self.origin), "compile": compiled + rest_compile,
                 "steps": net["steps"], "save": net["save"], "eval": net["eval"], "data": net["data"],
                 "other": rest - rest_compile}
        return with_wall({k: round(v, 6) for k, v in parts.items()})

    def close(self) -> None:
        """The run's clock stops: a later ``train()`` in this process starts its set-up here."""
        global _last_run_end
        self.closed = True
        _last_run_end = time.perf_counter()


def with_wall(parts: dict) -> dict:
    return {**{k: parts.get(k, 0.0) for k in PARTS}, "wall_seconds": round(sum(parts.get(k, 0.0) for k in PARTS), 6)}


def combine(carried: dict, this: dict) -> dict:
    """A resumed run's parts: the earlier processes' (up to the checkpoint) plus this one's."""
    return with_wall({k: round(carried.get(k, 0.0) + this.get(k, 0.0), 6) for k in PARTS})


def goodput(parts: dict) -> float | None:
    wall = parts.get("wall_seconds") or 0.0
    return round(parts.get("steps", 0.0) / wall, 6) if wall > 0 else None
