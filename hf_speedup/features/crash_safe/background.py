"""The writer thread of asynchronous checkpoints: one save in flight, the next one waits for it.

A thread, not a process: the writes spend their time in ``torch.save``'s and safetensors' C++/Rust code and in
the kernel's ``write``, which release the GIL (a 512 MB ``torch.save`` on a thread left the main thread's longest
pause at 7 ms). What a write takes from training is CPU: on a CPU device training keeps every core busy, and a
writer at the same priority slowed the steps beside it 3x (SmolLM2-135M on 2 cores, ``benchmarks/async_save.py``).
So the writer runs at a low priority (niceness 19: the cores training leaves idle, nearly free on a GPU host) and
gets more of the CPU (10, then 0) only while writes are found unfinished when the next save comes. The thread is not a daemon: a process
that ends (an exception, ``sys.exit``) still finishes the checkpoint it started, and it never becomes visible
half-written, since it is renamed into place last.

Across processes, each rank's writer ends its checkpoint with two collectives on a process group of its own (gloo,
made once by every rank together, so they never interleave with the training's collectives on the default group):
"did every rank write its part" (then the saving process renames the folder into place) and "the rename is done".
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

logger = logging.getLogger("hf_speedup")


@dataclass
class Pending:
    """One checkpoint being written."""

    name: str
    thread: threading.Thread
    started: float
    error: BaseException | None = None
    done: bool = False


@dataclass
class SaveRecord:
    """What the report says about the background saves of this run."""

    saved: int = 0
    failed: list[dict] = field(default_factory=list)
    write_seconds: float = 0.0
    waited_seconds: float = 0.0  # the training thread waiting for a write still in flight
    written_bytes: int = 0
    niceness: str = ""  # the last writer's scheduling priority, or why it could not be lowered


class BackgroundWriter:
    """Runs one checkpoint's writes and its commit on a thread; :meth:`wait` blocks until it is finished."""

    def __init__(self) -> None:
        self.pending: Pending | None = None
        self.record = SaveRecord()
        self.level = 0  # index into NICENESS
        self._group = None  # the writers' own process group (several processes)

    def group(self):
        """The writers' process group; collective: every rank calls it at the same save."""
        import torch.distributed as dist

        if self._group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def submit(self, name: str, work: Callable[[], None]) -> None:
        """Start writing; the caller has waited for the previous save (:meth:`wait`)."""
        assert self.pending is None or self.pending.done, "one save in flight"
        pending = Pending(name, None, time.perf_counter())  # type: ignore[arg-type]
        niceness = NICENESS[self.level]

        def run() -> None:
            self.record.niceness = _yield_the_cpu(niceness)
            try:
                work()
            except BaseException as exc:  # noqa: BLE001 - reported by wait(), never lost
                pending.error = exc
            finally:
                pending.done = True
                self.record.write_seconds += time.perf_counter() - pending.started

        pending.thread = threading.Thread(target=run, name=f"hf_speedup-save-{name}", daemon=False)
        self.pending = pending
        pending.thread.start()

    def wait(self, adapt: bool = False) -> float:
        """Block until the save in flight is finished; the seconds waited. ``adapt`` (the next save is waiting):
        the next writer gets more of the CPU if this one was not done, less if it was."""
        pending = self.pending
        if pending is None:
            return 0.0
        if adapt:
            self.level = min(self.level + 1, len(NICENESS) - 1) if not pending.done else max(self.level - 1, 0)
        started = time.perf_counter()
        pending.thread.join()
        if pending.error is not None:  # raised outside the save's own handling (a collective with a dead rank)
            logger.warning("hf_speedup crash_safe: the background save of %s ended with %s: %s", pending.name,
                           type(pending.error).__name__, pending.error)
            self.record.failed.append({"checkpoint": pending.name, "error": f"{type(pending.error).__name__}: "
                                                                            f"{pending.error}"})
        waited = time.perf_counter() - started
        self.record.waited_seconds += waited
        self.pending = None
        return waited

    @property
    def busy(self) -> bool:
        return self.pending is not None and not self.pending.done


# the writer thread's niceness, from the gentlest: a save that had to wait for the previous write moves the next
# writer one level up (more of the CPU), a save that did not wait moves it one level back
NICENESS = (19, 10, 0)


def _yield_the_cpu(niceness: int) -> str:
    """Lower this thread's scheduling priority (Linux: per thread), so the writes take the cores training leaves
    idle instead of slowing its threads down; what it got, for the report. Where it cannot, the thread runs at the
    process's priority, and the report says so."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
        return str(niceness)
    except (AttributeError, OSError) as exc:
        logger.info("hf_speedup crash_safe: the writer thread keeps the process's priority (%s)", exc)
        return f"the process's (setpriority failed: {exc})"


def all_ranks_agree(group, ok: bool) -> bool:
    """True iff ``ok`` on every rank of ``group`` (True without one)."""
    if group is None:
        return ok
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
