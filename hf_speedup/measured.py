"""Speeds this machine measured for this model: what a plan decides by where no capability flag can tell.

Some choices depend on the model's shapes as much as on the hardware: a bf16 matmul is 2x an fp32 one on a
Zen 4 core at a 135M model's shapes and slower at a toy model's; the per-expert loop of a mixture of experts
beats grouped GEMMs on a CPU and loses on a GPU. Such a choice is measured, in process, at the door that
resolves the request (the trainer, :func:`~hf_speedup.plan.plan_for`), before :func:`~hf_speedup.plan.build_plan`,
which stays pure: a measurement is one more frozen input, carried in ``Capabilities.measured`` under a key the
measuring feature owns (``"precision.bf16_matmul"``). Tests set it directly to plan as on any machine.

Measurements are cached per machine (CPU or GPU name, threads, torch version, the shapes) in one JSON file,
``$HF_SPEEDUP_CACHE_DIR/measured.json`` (default ``~/.cache/hf_speedup``), so a second run pays nothing.
``HF_SPEEDUP_MEASURE=0`` turns measuring off: the plan then decides from the capability flags, and says so.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger("hf_speedup")

MEASURE_ENV = "HF_SPEEDUP_MEASURE"  # "0": decide from capability flags only (no timing at the door)
CACHE_ENV = "HF_SPEEDUP_CACHE_DIR"


@dataclass(frozen=True)
class Measurement:
    """One measured figure and what it is: the plan quotes ``text()`` as the reason of the choice it made."""

    value: Any  # a ratio, seconds, FLOP/s, or a {choice: seconds} table
    what: str  # what was timed, at which shapes ("bf16 vs fp32 matmuls at the model's shapes (...)")
    where: str = ""  # the machine ("AMD EPYC 9R14, 2 threads, torch 2.13.0")
    cached: bool = False  # read back from the cache rather than timed in this process

    def text(self) -> str:
        where = f" on {self.where}" if self.where else ""
        return f"{self.what}{where}{' (cached)' if self.cached else ''}"


def measuring_enabled(environ=None) -> bool:
    return (os.environ if environ is None else environ).get(MEASURE_ENV, "1").strip() not in ("0", "false", "no")


def cache_path() -> Path:
    root = os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "hf_speedup")
    return Path(root) / "measured.json"


def _read() -> dict:
    try:
        return json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _write(entries: dict) -> None:
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".measured.")
        with os.fdopen(fd, "w") as fh:
            json.dump(entries, fh, indent=1, sort_keys=True)
        os.replace(tmp, path)  # a reader sees the old file or the new one, never half of one
    except OSError as exc:  # a read-only home: measured again next time, said once
        logger.info("hf_speedup: could not cache a measurement in %s (%s)", path, exc)


def cached(kind: str, key: dict, measure: Callable[[], Measurement]) -> Measurement:
    """The measurement of ``kind`` for ``key`` (machine, shapes, dtype: everything the figure depends on),
    timed by ``measure()`` the first time on this machine and read back from the cache after."""
    full = _full_key(kind, key)
    entries = _read()
    if full in entries:
        try:
            return Measurement(**{**entries[full], "cached": True})
        except TypeError:  # written by another version of this module
            pass
    result = measure()
    entries = _read()  # another process may have written meanwhile
    entries[full] = {**asdict(result), "cached": False}
    _write(entries)
    return result


def _full_key(kind: str, key: dict) -> str:
    return json.dumps({"kind": kind, **key}, sort_keys=True, default=str)


def lookup(kind: str, key: dict) -> Measurement | None:
    """What an earlier run on this machine recorded for ``kind`` at ``key`` (read back: ``cached=True``), or None."""
    entry = _read().get(_full_key(kind, key))
    try:
        return Measurement(**{**entry, "cached": True}) if entry is not None else None
    except TypeError:  # written by another version of this module
        return None


def record(kind: str, key: dict, result: Measurement) -> None:
    """Keep a figure a run measured along the way (a compiled run's gain and compile time) for later runs' plans;
    a newer figure replaces an older one."""
    entries = _read()
    entries[_full_key(kind, key)] = {**asdict(result), "cached": False}
    _write(entries)


_CEILINGS_TIMED: dict[str, Measurement] = {}  # (cache file, kind, key) -> the best figure this process timed


def best(kind: str, key: dict, measure: Callable[[], Measurement]) -> Measurement:
    """A ceiling (a matmul peak): timed again by every process (a run) and the highest figure this machine has shown
    kept, so a timing taken while other work shared the machine cannot stick as the ceiling; the figure of an
    earlier run is returned (``cached=True``) where it stays the best. Timed once per process: a script or a test
    suite calling ``train()`` many times pays the timing once."""
    tag = json.dumps([str(cache_path()), _full_key(kind, key)])
    kept = lookup(kind, key)
    mine = _CEILINGS_TIMED.get(tag)
    if mine is not None:
        return kept if kept is not None and float(kept.value) >= float(mine.value) else mine
    fresh = measure()
    _CEILINGS_TIMED[tag] = fresh
    kept = lookup(kind, key)  # another process may have written meanwhile
    if kept is not None and float(kept.value) >= float(fresh.value):
        return kept
    record(kind, key, fresh)
    return fresh


def shared_across_ranks(measure: Callable[[], dict]) -> dict:
    """Ranks must plan alike: where a process group is up, rank 0 measures and every rank takes its figures."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            box = [measure() if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(box, src=0)
            return box[0]
    except (ImportError, RuntimeError) as exc:  # a group that cannot broadcast objects: each rank measures
        logger.info("hf_speedup: measurements not shared across ranks (%s)", exc)
    return measure()
