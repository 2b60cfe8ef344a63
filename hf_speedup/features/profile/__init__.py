"""See inside a step: torch.profiler over a window of training steps, with labelled regions.

``profile.enabled`` (or ``--profile`` on ``examples/finetune.py``) profiles optimizer steps
``wait + warmup + 1 .. wait + warmup + active`` of the run (``torch.profiler.schedule``; the first
``wait`` steps are skipped because they allocate and compile, ``warmup`` ones start the profiler up):

- labels (``record_function``): ``hf_speedup/block.<i>`` around each decoder block's forward (also its
  recomputation in backward under checkpointing), ``hf_speedup/loss`` around the model's loss function,
  ``hf_speedup/optimizer_step`` around the optimizer step;
- a trace written by ``torch.profiler.tensorboard_trace_handler`` to ``<output_dir>/profile/train/``
  (``<worker>.<ns>.pt.trace.json``, Chrome trace format): ``tensorboard --logdir <output_dir>/profile``
  with the ``torch-tb-profiler`` plugin, or open the file in https://ui.perfetto.dev;
- the top operators by self time (CPU, or device time on CUDA) in the report's ``profile`` section and
  printed when the window closes, with the step's time by bucket (``time_breakdown``: matmul, attention, loss,
  optimizer, data, compiled kernels, other operators, Python/framework overhead; :mod:`.breakdown`);
- on CUDA a memory snapshot of the profiled steps (``torch.cuda.memory._record_memory_history`` ->
  ``memory_snapshot_<worker>.pickle`` beside the trace, for https://pytorch.org/memory_viz). On CPU there
  is no caching allocator to record: reported as not engaged, with that reason.

Labels cost a few microseconds per block call outside the window (the profiler is off then); the window
itself is slower (the profiler records every operator), so its step times are not the run's.

Engagement rule: ``engaged`` is True iff the labels are on the live model (one pre- and post-hook per
block, the labelled loss) and the profiler callback is registered with the trainer; once the window has
closed, iff its trace file exists.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import TrainerCallback

from ...blocks import find_blocks, unwrap_model
from ...callback_handler import all_callbacks
from ...plan_types import OFF, Decision, Outcome, PlanContext
from ..compile.payback import MEASURED_STEPS
from .breakdown import breakdown_lines, time_breakdown

NAME = "profile"
APPLIES_TO = "model"
logger = logging.getLogger("hf_speedup")
LABEL = "hf_speedup/"
BLOCK_LABEL, LOSS_LABEL, OPTIMIZER_LABEL = LABEL + "block.{}", LABEL + "loss", LABEL + "optimizer_step"
TRACE_SUBDIR, RUN_NAME = "profile", "train"
HOOKS_ATTR = "_hf_speedup_profile_hooks"
SNAPSHOT_CPU_REASON = ("CUDA only: torch.cuda.memory._record_memory_history records the CUDA caching allocator; on "
                       "{device} there is none (see the trace's memory events with profile.profile_memory: true)")


@dataclass(frozen=True)
class Settings:
    enabled: bool = False
    wait: int = 1
    warmup: int = 1
    active: int = 2
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    memory_snapshot: bool = False  # decided: requested and on CUDA
    top_operators: int = 15
    device: str = "cpu"

    @property
    def window(self) -> tuple[int, int]:
        """First and last profiled optimizer step of the run (1-based, as ``state.global_step``)."""
        return self.wait + self.warmup + 1, self.wait + self.warmup + self.active


# ------------------------------------------------------------------------------------------- decide
def decide(ctx: PlanContext) -> Decision:
    s = ctx.config.profile
    requested = {"enabled": s.enabled, "wait": s.wait, "warmup": s.warmup, "active": s.active}
    if not s.enabled:
        return Decision(NAME, requested, OFF, settings=Settings(),
                        reason="off in the config (profile.enabled: true, or --profile on examples/finetune.py)")
    device = ctx.caps.device_type
    snapshot = bool(s.memory_snapshot) and device == "cuda"
    fallbacks = ()
    if s.memory_snapshot and not snapshot:
        fallbacks = (f"memory_snapshot: {SNAPSHOT_CPU_REASON.format(device=device)}",)
    wait, shifted = _after_compile_payback(ctx, s.wait)
    settings = Settings(True, wait, s.warmup, s.active, s.record_shapes, s.profile_memory, s.with_stack,
                        snapshot, s.top_operators, device)
    first, last = settings.window
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    reason = (f"torch.profiler on {steps} (after {wait} skipped + {s.warmup} warm-up): labelled blocks, loss and "
              f"optimizer step; trace -> <output_dir>/{TRACE_SUBDIR}/{RUN_NAME}/ (TensorBoard, Perfetto); top "
              f"{s.top_operators} operators by self time in the report")
    if shifted:
        reason += (f"; profile.wait {s.wait} -> {wait}: compile.when = pays_back times the first steps eager and may "
                   "compile the step after, which the window should neither slow nor contain")
    reason += "; CUDA memory snapshot of the window" if snapshot else (
        f"; memory snapshot not taken: {SNAPSHOT_CPU_REASON.format(device=device)}" if s.memory_snapshot else "")
    return Decision(NAME, requested, steps, settings=settings, reason=reason, fallbacks=fallbacks)


def _after_compile_payback(ctx: PlanContext, wait: int) -> tuple[int, bool]:
    """(steps to skip, whether that was raised) so the window opens after compile.when = pays_back has timed its
    steps and compiled (or not) on the step after them."""
    compile_ = ctx.decisions.get("compile")
    if compile_ is None or not compile_.active or getattr(compile_.settings, "when", "always") != "pays_back":
        return wait, False
    least = MEASURED_STEPS + 2
    return max(wait, least), wait < least


# -------------------------------------------------------------------------------------------- apply
def training_args(decision: Decision, args) -> dict:
    return {}


def apply(decision: Decision, setup, outcome: Outcome) -> None:
    """Label the blocks and the loss (cheap outside the window: the profiler is off then)."""
    if not decision.settings.enabled or setup.model is None:
        return
    blocks = find_blocks(setup.model)
    for i, block in enumerate(blocks):
        label_module(block, BLOCK_LABEL.format(i))
    base = unwrap_model(setup.model)
    if hasattr(type(base), "loss_function") and not isinstance(vars(base).get("_loss_function"), LabelledLoss):
        base.loss_function = LabelledLoss(base.loss_function)
    outcome.facts["labelled_blocks"] = len(blocks)


def label_module(module, label: str) -> None:
    """``record_function(label)`` around every forward of ``module`` (idempotent)."""
    if getattr(module, HOOKS_ATTR, None):
        return
    stack: list = []

    @torch.compiler.disable
    def enter(mod, args):
        rf = torch.autograd.profiler.record_function(label)
        rf.__enter__()
        stack.append(rf)

    @torch.compiler.disable
    def leave(mod, args, output):
        if stack:
            stack.pop().__exit__(None, None, None)

    handles = (module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True))
    setattr(module, HOOKS_ATTR, (label, handles))


def labelled_modules(model) -> list[str]:
    return [getattr(m, HOOKS_ATTR)[0] for m in model.modules() if getattr(m, HOOKS_ATTR, None)]


class LabelledLoss:
    """The model's loss function inside ``record_function('hf_speedup/loss')``."""

    def __init__(self, inner):
        self.inner = inner

    @torch.compiler.disable(recursive=False)
    def __call__(self, *args, **kwargs):
        with torch.autograd.profiler.record_function(LOSS_LABEL):
            return self.inner(*args, **kwargs)


# ------------------------------------------------------------------------------------- the callback
def callbacks(decision: Decision, trainer, outcome: Outcome) -> list:
    """The profiler callback for the trainer (none when off)."""
    return [ProfilerCallback(decision.settings, trainer, outcome)] if decision.settings.enabled else []


class ProfilerCallback(TrainerCallback):
    """Runs torch.profiler over the decided window; results go to ``trainer.speedup_report.profile``."""

    def __init__(self, settings: Settings, trainer=None, outcome: Outcome | None = None):
        self.settings = settings
        self.trainer = trainer
        self.outcome = outcome if outcome is not None else Outcome()
        self.prof = None
        self.results: dict | None = None
        self.steps_seen = 0
        self.optimizer_range = None
        self.snapshot_recording = False

    # -------------------------------------------------------------------------- window
    def on_train_begin(self, args, state, control, **kwargs):
        s = self.settings
        self.trace_dir = Path(args.output_dir) / TRACE_SUBDIR / RUN_NAME
        self.worker = f"{socket.gethostname()}_rank{getattr(args, 'process_index', 0)}_{os.getpid()}"
        self.steps_seen, self.results = 0, None
        self._publish()  # no stale results from an earlier train() in the report
        activities = [torch.profiler.ProfilerActivity.CPU]
        if s.device == "cuda" and torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.first_step = state.global_step + s.wait + s.warmup + 1
        self.prof = torch.profiler.profile(
            activities=activities, record_shapes=s.record_shapes, profile_memory=s.profile_memory,
            with_stack=s.with_stack, on_trace_ready=self._trace_ready,
            schedule=torch.profiler.schedule(wait=s.wait, warmup=s.warmup, active=s.active, repeat=1))
        self.prof.start()

    def on_step_begin(self, args, state, control, **kwargs):
        s = self.settings
        if s.memory_snapshot and self.prof is not None and self.steps_seen == s.wait + s.warmup:
            # Python frames only: "all" symbolizes C++ frames at the dump (minutes, and it can hang on generated code)
            torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
            self.snapshot_recording = True

    def on_step_end(self, args, state, control, **kwargs):
        if self.prof is None:
            return
        self.steps_seen += 1
        self.last_step = state.global_step
        self.prof.step()  # the last active step's trace is written here (on_trace_ready)
        if self.steps_seen >= self.settings.wait + self.settings.warmup + self.settings.active:
            self._stop()

    def on_train_end(self, args, state, control, **kwargs):
        if self.prof is None:
            return
        s = self.settings
        if self.steps_seen <= s.wait + s.warmup:
            self.outcome.facts["window_missed"] = True
            self.outcome.notes.append(f"training ended after {self.steps_seen} step(s), before the profile window "
                                      f"(steps {s.window[0]}-{s.window[1]}): no trace; lower profile.wait/warmup")
        else:  # ended inside the window: keep what was recorded
            self.outcome.notes.append(f"training ended after {self.steps_seen} step(s), inside the profile window")
        self._stop()

    def _stop(self) -> None:
        prof, self.prof = self.prof, None
        prof.stop()  # writes the trace if the window was still recording
        self._end_snapshot()

    # -------------------------------------------------------------------------- labels
    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.optimizer_range = torch.autograd.profiler.record_function(OPTIMIZER_LABEL)
        self.optimizer_range.__enter__()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.optimizer_range is not None:
            self.optimizer_range.__exit__(None, None, None)
            self.optimizer_range = None

    # -------------------------------------------------------------------------- results
    def _end_snapshot(self) -> None:
        if not self.snapshot_recording:
            return
        path = self.trace_dir / f"memory_snapshot_{self.worker}.pickle"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            self.outcome.facts["memory_snapshot"] = str(path)
        except Exception as exc:  # a failed dump must not end training
            self.outcome.fallbacks.append(f"memory_snapshot: dump failed: {exc!r}")
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
            self.snapshot_recording = False
        if self.results is not None:
            self.results["memory_snapshot"] = self._snapshot_entry()
            self._publish()

    def _trace_ready(self, prof) -> None:
        torch.profiler.tensorboard_trace_handler(str(self.trace_dir), worker_name=self.worker)(prof)
        files = sorted(str(p) for p in self.trace_dir.glob(f"{self.worker}.*.pt.trace.json"))
        self.outcome.facts["trace_file"] = files[-1] if files else None
        averages = prof.key_averages()
        self.results = {
            "trace_dir": str(self.trace_dir),
            "trace_file": files[-1] if files else None,
            "open_with": (f"tensorboard --logdir {self.trace_dir.parent} (torch-tb-profiler), or "
                          "https://ui.perfetto.dev"),
            "steps": [self.first_step, getattr(self, "last_step", self.first_step)],
            "labels": sorted({e.key for e in averages if e.key.startswith(LABEL)}, key=_label_order),
            **top_operators(averages, self.settings.top_operators, self.settings.device == "cuda"),
            "time_breakdown": time_breakdown(prof.events(), self.settings.device == "cuda"),
            "memory_snapshot": self._snapshot_entry(),
        }
        self._publish()
        if self.trainer is None or self.trainer.is_world_process_zero():
            sort_by = self.results["sort_by"]
            first, last = self.results["steps"]
            split = breakdown_lines(self.results["time_breakdown"])
            print(f"hf_speedup profile: steps {first}-{last}, trace {self.results['trace_file']}\n"
                  + averages.table(sort_by=sort_by, row_limit=self.settings.top_operators)
                  + (f"\nstep time by bucket: {', '.join(split)}" if split else ""))

    def _snapshot_entry(self) -> dict:
        if not self.settings.memory_snapshot:
            return {"engaged": False, "path": None, "reason": SNAPSHOT_CPU_REASON.format(device=self.settings.device)}
        path = self.outcome.facts.get("memory_snapshot")
        return {"engaged": bool(path), "path": path,
                "reason": "allocator history of the profiled steps, for https://pytorch.org/memory_viz" if path
                else _snapshot_failure(self.outcome) or "written when the window closes"}

    def _publish(self) -> None:
        report = getattr(self.trainer, "speedup_report", None)
        if report is not None:
            report.profile = self.results


def _snapshot_failure(outcome: Outcome) -> str | None:
    return next((f for f in outcome.fallbacks if f.startswith("memory_snapshot:")), None)


def top_operators(averages, n: int, device: bool) -> dict:
    """The ``n`` operators with the most self time (device time on CUDA), labels excluded."""
    key = "self_device_time_total" if device else "self_cpu_time_total"
    ops = [e for e in averages if not e.key.startswith((LABEL, "ProfilerStep"))]
    total = sum(getattr(e, key) for e in ops) or 1
    rows = []
    for e in sorted(ops, key=lambda e: getattr(e, key), reverse=True)[:n]:
        row = {"name": e.key, "calls": e.count, "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
               "cpu_total_ms": round(e.cpu_time_total / 1e3, 3),
               "self_percent": round(100 * getattr(e, key) / total, 2)}
        if device:
            row["self_device_ms"] = round(e.self_device_time_total / 1e3, 3)
        rows.append(row)
    return {"sort_by": key, "top_operators": rows}


def _label_order(name: str):
    rest = name[len(LABEL):]
    return (0, int(rest.split(".")[1])) if rest.startswith("block.") else (1, rest)


# -------------------------------------------------------------------------------------------- verify
def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    s = decision.settings
    if not s.enabled:
        return False, decision.reason
    labels = labelled_modules(trainer.model)
    loss = isinstance(vars(unwrap_model(trainer.model)).get("_loss_function"), LabelledLoss)
    registered = any(isinstance(cb, ProfilerCallback) for cb in all_callbacks(trainer))
    parts = [f"{len(labels)} labelled blocks", "labelled loss" if loss else "loss not labelled",
             "profiler callback registered" if registered else "profiler callback MISSING"]
    snapshot = ("memory snapshot " + (outcome.facts.get("memory_snapshot") or _snapshot_failure(outcome)
                                      or "after the window")
                if s.memory_snapshot else f"no memory snapshot on {s.device}")
    trace = outcome.facts.get("trace_file")
    if outcome.facts.get("window_missed"):
        return False, f"training ended before the profile window (steps {s.window[0]}-{s.window[1]}): no trace"
    if trace is not None:
        ok = Path(trace).is_file()
        return ok, f"trace {'written' if ok else 'MISSING'}: {trace}; {', '.join(parts)}; {snapshot}"
    return bool(labels) and registered, f"{', '.join(parts)}; trace after step {s.window[1]}; {snapshot}"
