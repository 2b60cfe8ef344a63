"""The report's schema: the verified plan plus measured metrics, as one JSON-serialisable object.

This module owns the report's shape (sections, metric names, file name, version); the collector fills
it, the sinks (JSON, W&B, console) and ``hf-speedup report`` only read it.

``to_dict()`` sections:

- ``plan``: per feature ``requested / applied / engaged / reason`` (engaged verified on the live objects);
- ``metrics``: the steady-state numbers of DESIGN.md (null until training ran; ``mfu`` null where the
  peak FLOP/s is unknown) and beside them the whole-run ones (``whole_run_*``: wall clock, compiles and
  recompiles included) with the seconds spent compiling (``compile_seconds``, of which
  ``recompile_seconds`` after the first step);
- ``metrics`` also states the step against this machine's own limit: ``model_flops_per_second`` (achieved:
  FLOPs per token x steady tokens/s, all ranks; ``whole_run_model_flops_per_second`` on the wall clock),
  ``matmul_peak_flops_per_second`` (a large GEMM in the run's dtype timed in process at every run, the best
  figure this machine has shown kept; null with ``HF_SPEEDUP_MEASURE=0``) and ``fraction_of_matmul_peak`` (achieved / (matmul peak x devices));
- ``metrics`` also has the run's ``goodput`` (productive step seconds / wall clock from process start) with the
  wall clock's parts (``setup_seconds``, ``compile_seconds``, ``productive_step_seconds``, ``save_blocked_seconds``,
  ``eval_seconds``, ``data_wait_seconds``, ``other_seconds``: they sum to ``wall_clock_seconds``);
- ``measurement``: how the metrics were obtained (steps, tokens, FLOPs per token, peak used, dtype ...;
  ``time_split``: the parts of the run and of this process, and what a resumed run's figures cover);
- ``environment``: package versions and the device;
- ``history``: one entry per logging step (throughput, step time, memory), bounded in length;
- ``step_times``: ``[global_step, seconds, compiled]`` per optimizer step, bounded in length;
- ``profile``: null unless ``profile.enabled``; then the profiled steps, the trace file (TensorBoard /
  Perfetto), the labels found in it, the top operators by self time, ``time_breakdown`` (the profiled step's
  time by bucket: matmul, attention, loss, optimizer, data, compiled, elementwise, overhead) and the
  CUDA memory snapshot (or why none);
- ``capabilities``, ``model``, ``config``: what the plan was built from.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..plan_types import Outcome, Plan
from .console import plan_table

REPORT_FILE = "speedup_report.json"
# 2: the allocator feature is reported under "memory" (its module and config section); "empty_cache"
# stays as an alias of the same entry for readers of version 1.
REPORT_VERSION = 2
ALIASES = {"empty_cache": "memory"}
PREFIX = "hf_speedup/"  # tracker keys: hf_speedup/<metric>, hf_speedup/<feature>/<field>
PLAN_FIELDS = ("requested", "applied", "engaged", "reason", "fallbacks")  # what trackers get of each feature


@dataclass
class Metrics:
    """The run's steady-state summary (DESIGN.md's metric definitions); None until measured or where
    unknown (``mfu`` without a known peak)."""

    tokens_per_second: float | None = None  # non-padding tokens, all ranks, steady state
    samples_per_second: float | None = None
    step_time_s: float | None = None  # median of the steady-state steps
    # whole run: wall clock from the first step to the last, compiles, recompiles, data loading and logging included
    whole_run_tokens_per_second: float | None = None
    whole_run_samples_per_second: float | None = None
    whole_run_seconds: float | None = None
    mfu: float | None = None
    # achieved model FLOP/s (FLOPs per token x tokens/s, all ranks): steady state and whole run
    model_flops_per_second: float | None = None
    whole_run_model_flops_per_second: float | None = None
    matmul_peak_flops_per_second: float | None = None  # this machine's measured GEMM FLOP/s per device, run's dtype
    fraction_of_matmul_peak: float | None = None  # model_flops_per_second / (matmul peak x devices)
    peak_memory_allocated_bytes: int | None = None
    peak_memory_reserved_bytes: int | None = None  # CPU: peak RSS of the process
    compile_seconds: float | None = None  # dynamo + backend, every compile of the run
    recompile_seconds: float | None = None  # the part of compile_seconds spent after the first step
    recompiles: int | None = None
    graph_breaks: int | None = None
    compiled_regions: int | None = None
    estimated_peak_bytes: int | None = None  # hf_speedup.estimate_memory: live tensors at the peak (any device)
    trainable_parameters: int | None = None
    total_parameters: int | None = None
    # goodput (report/goodput.py): the wall clock from process start to the end of training, every train() of a
    # resumed run up to its checkpoint included, in parts that sum to it: set-up, compile (compile_seconds), the
    # productive step time, blocked by saves, evaluation, waiting for data, other
    goodput: float | None = None  # productive_step_seconds / wall_clock_seconds
    wall_clock_seconds: float | None = None  # process start (psutil create_time) to the end of training
    setup_seconds: float | None = None  # process start to the first step: imports, model, trainer, checkpoint load
    productive_step_seconds: float | None = None  # on_step_begin to on_step_end, compiling inside left out
    save_blocked_seconds: float | None = None  # the main thread in a save (asynchronous: waits for one in flight)
    eval_seconds: float | None = None  # inside evaluate during training
    data_wait_seconds: float | None = None  # inside the Trainer's get_batch_samples (the loader's next)
    other_seconds: float | None = None  # the rest: logging, callbacks, epoch boundaries


SUMMARY_METRICS = tuple(f.name for f in dataclasses.fields(Metrics))
# Logged at every logging step (the summary adds the rest).
STEP_METRICS = ("tokens_per_second", "samples_per_second", "step_time_s", "mfu", "model_flops_per_second",
                "fraction_of_matmul_peak", "peak_memory_allocated_bytes",
                "peak_memory_reserved_bytes", "recompiles", "whole_run_tokens_per_second", "compile_seconds")


def plan_entries(plan: Plan, outcomes: dict[str, Outcome] | None = None) -> dict:
    entries = {name: state.to_dict() for name, state in plan.states(outcomes).items()}
    for alias, name in ALIASES.items():
        if name in entries:
            entries[alias] = entries[name]
    return entries


@dataclass
class Report:
    plan: Plan
    outcomes: dict = field(default_factory=dict)  # feature -> Outcome (what apply and verify found)
    metrics: Metrics | dict = field(default_factory=Metrics)
    environment: dict = field(default_factory=dict)
    measurement: dict = field(default_factory=dict)
    history: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    profile: dict | None = None  # filled by the profile feature's callback when its window closes

    def to_dict(self) -> dict:
        metrics = dataclasses.asdict(self.metrics) if isinstance(self.metrics, Metrics) else \
            {**{k: None for k in SUMMARY_METRICS}, **self.metrics}
        return {
            "report_version": REPORT_VERSION,
            "preset": self.plan.config.name,
            "plan": plan_entries(self.plan, self.outcomes),
            "metrics": metrics,
            "measurement": dict(self.measurement),
            "environment": dict(self.environment),
            "history": list(self.history),
            "step_times": list(self.step_times),
            "profile": dict(self.profile) if self.profile is not None else None,
            "capabilities": self.plan.caps.to_dict(),
            "model": self.plan.model.to_dict() if self.plan.model else None,
            "config": self.plan.config.to_dict(),
        }

    def table(self, width: int = 80, max_reason_lines: int | None = 3) -> str:
        """The plan as a table (what is printed when training starts); reasons capped at a few lines."""
        verified = any(o.engaged is not None for o in self.outcomes.values())
        return plan_table(self.to_dict(), width=width, max_reason_lines=max_reason_lines, verified=verified)


def load_report(path: str | Path) -> dict:
    """A report dict from a ``speedup_report.json`` file or a run directory that holds one
    (directly, or below it: the newest one wins)."""
    p = Path(path)
    if p.is_dir():
        direct = p / REPORT_FILE
        if direct.is_file():
            p = direct
        else:
            found = sorted(p.rglob(REPORT_FILE), key=lambda q: q.stat().st_mtime)
            if not found:
                raise FileNotFoundError(f"no {REPORT_FILE} in {path} (nor below it); pass a training output_dir "
                                        f"or the JSON file itself")
            p = found[-1]
    elif not p.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass a training output_dir or a {REPORT_FILE}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or "plan" not in data:
        raise ValueError(f"{p} is not an hf_speedup report (no 'plan' section)")
    data.setdefault("_path", str(p))
    return data
