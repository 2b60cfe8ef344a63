"""The report's counters across a resume: written beside ``trainer_state.json`` in every checkpoint, read back
when ``train(resume_from_checkpoint=...)`` starts, so the final report counts the whole run (steps, tokens,
compile statistics, history, where the wall clock went), however many times it was interrupted.

The file is ``checkpoint-<step>/hf_speedup_state.json``; a checkpoint without one (written by the stock
Trainer, or an older version) resumes with counts starting at the resume, and the report says so.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from .sinks import write_json_atomically

logger = logging.getLogger("hf_speedup")

STATE_FILE = "hf_speedup_state.json"
CARRY_VERSION = 1


@dataclass
class Carried:
    """Totals of the runs before this one (all ranks; what rank 0 wrote at the checkpoint)."""

    global_step: int = 0  # the checkpoint's step
    segments: int = 0  # train() runs these totals cover
    steps: int = 0
    warmup_steps: int = 0
    tokens: int = 0
    samples: int = 0
    attended_tokens: int = 0  # sum(L_i) and sum(L_i^2) over sequences: attention's FLOPs
    attended_squares: int = 0
    wall_seconds: float = 0.0
    compile_seconds: float = 0.0
    recompile_seconds: float = 0.0  # compile seconds after each segment's first step
    recompiles: int = 0
    graph_breaks: int = 0
    dynamo_frames: int = 0
    warmup_global_steps: list = field(default_factory=list)
    steady_step_times: list = field(default_factory=list)  # the latest ones, bounded: the median's sample
    history: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    # where the wall clock went (report/goodput.py's parts plus wall_seconds), summed over the processes of
    # ``time_split_runs`` train() runs, each up to the checkpoint that carried it: {} in older checkpoints
    time_split: dict = field(default_factory=dict)
    time_split_runs: int = 0


def write(carried: Carried, checkpoint_dir: str | Path) -> Path | None:
    """Atomically into the checkpoint; on failure a warning (a report must never end a run)."""
    return write_json_atomically(Path(checkpoint_dir) / STATE_FILE,
                                 {"version": CARRY_VERSION, **dataclasses.asdict(carried)},
                                 "a resume from this checkpoint restarts the report's counts")


def read(checkpoint_dir: str | Path) -> tuple[Carried | None, str]:
    """(the counters saved in a checkpoint, or None; what happened, for the report)."""
    path = Path(checkpoint_dir) / STATE_FILE
    if not path.is_file():
        return None, f"{path.name} not in {checkpoint_dir}: the report counts from this resume on"
    try:
        data = json.loads(path.read_text())
        names = {f.name for f in dataclasses.fields(Carried)}
        if not isinstance(data, dict) or data.get("version") != CARRY_VERSION:
            raise ValueError(f"version {data.get('version') if isinstance(data, dict) else None!r}, "
                             f"expected {CARRY_VERSION}")
        return Carried(**{k: v for k, v in data.items() if k in names}), f"counters carried over from {path}"
    except (OSError, ValueError, TypeError) as exc:
        logger.warning("hf_speedup: %s is unreadable (%s); the report counts from this resume on", path, exc)
        return None, f"{path} unreadable ({exc}): the report counts from this resume on"
