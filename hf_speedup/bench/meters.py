"""What a bench worker measures besides time: the tokens of each optimizer step, counted as the trainer's
``training_step`` receives its batches, what of each step waited for data, saved or compiled, on CPU one step's
live tensor bytes under torch's MemTracker, and with ``--breakdown`` where one profiled step's time goes."""

from __future__ import annotations

from ..features.profile.breakdown import time_breakdown
from ..report.goodput import PhaseClock
from ..report.measure import attention_length, batch_counts
from ..report.measure.memory_watch import NoHook


class TokenMeter:
    """Non-padding tokens per optimizer step, as the trainer's ``training_step`` receives its batches."""

    def __init__(self) -> None:
        self.current: list = []
        self.steps: list[list] = []

    def add(self, inputs) -> None:
        self.current.append(batch_counts(inputs))  # the report's own counting, on the device (no sync)

    def close_step(self) -> None:
        self.steps.append(self.current)
        self.current = []

    def per_step(self) -> list[int]:
        return [int(sum(int(x[0]) for x in parts)) for parts in self.steps]

    def attention_length(self) -> float | None:
        """S of the FLOPs formula over every step: sum(L_i^2) / sum(L_i) of the sequences trained on."""
        counts = [x for parts in self.steps for x in parts]
        return attention_length(sum(int(x[2]) for x in counts), sum(int(x[3]) for x in counts)) if counts else None


class StepSplit:
    """Per timed step, the seconds it waited for data (inside the trainer's ``get_batch_samples``), was blocked by a
    save (from the last event before it to ``on_save``) and compiled (dynamo's compile seconds): what of the step is
    not productive (report/goodput.py's parts, on the bench's clock)."""

    KEYS = ("data", "save", "compile")

    def __init__(self) -> None:
        self.clock = PhaseClock(("data", "save"))
        self.steps: list[dict] = []
        self.last: dict | None = None

    def _snapshot(self) -> dict:
        now = self.clock.now()
        net, _ = self.clock.totals(now)
        return {"data": net["data"], "save": net["save"], "compile": now[1]}

    def begin(self) -> None:
        """The first step's clock starts."""
        self.last = self._snapshot()
        self.clock.mark()

    def close_step(self) -> None:
        """A timed step ended: what of it went to each part since the previous one."""
        snap = self._snapshot()
        last = self.last or snap
        self.steps.append({k: round(max(0.0, snap[k] - last[k]), 6) for k in self.KEYS})
        self.last = snap

    def per_step(self) -> dict[str, list[float]]:
        return {k: [s[k] for s in self.steps] for k in self.KEYS}


class MemoryProbe:
    """CPU: live tensor bytes of one step as torch's MemTracker counts them (parameters, gradients,
    optimizer state, activations, temporaries). Under its dispatch mode torch.compile steps aside, so the
    tracked step runs eager: compiled variants show their eager footprint."""

    def __init__(self) -> None:
        self.tracker = None
        self.peak_bytes: int | None = None
        self.breakdown: dict = {}
        self.error: str | None = None

    def start(self, model, optimizer) -> None:
        try:
            from torch.distributed._tools.mem_tracker import MemTracker

            from ..compat import unwrap_optimizer

            self.tracker = MemTracker()
            # MemTracker puts a gradient hook on every parameter, which torch refuses for frozen ones (LoRA's
            # base): mark those as hooked already, with a handle that removes nothing.
            for param in model.parameters():
                if not param.requires_grad:
                    self.tracker._param_to_grad_hook_handles[param] = (NoHook(), NoHook())
            self.tracker.track_external(model, unwrap_optimizer(optimizer) if optimizer is not None else None)
            self.tracker.__enter__()
        except Exception as exc:  # the measurement must never break the benchmark; say why instead
            self.tracker, self.error = None, f"MemTracker could not start: {exc!r}"

    def stop(self) -> None:
        if self.tracker is None:
            return
        try:
            self.tracker.__exit__(None, None, None)
            peak = self.tracker.get_tracker_snapshot("peak")
            self.peak_bytes = int(sum(v.get("Total", 0) for v in peak.values()))
            for per_device in peak.values():
                for key, value in per_device.items():
                    name = str(getattr(key, "name", key)).lower()
                    if name != "total":
                        self.breakdown[name] = self.breakdown.get(name, 0) + int(value)
        except Exception as exc:
            self.error = f"MemTracker failed: {exc!r}"
        self.tracker = None


class StepProfiler:
    """One step under torch.profiler (after the timed ones: the profiler slows it), its time by bucket."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.prof = None
        self.breakdown: dict | None = None
        self.error: str | None = None

    def start(self) -> None:
        try:
            import torch

            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.start()
        except Exception as exc:  # the breakdown must never break the benchmark; say why instead
            self.prof, self.error = None, f"torch.profiler could not start: {exc!r}"

    def stop(self, seconds: float) -> None:
        """Stop and sort the step's operators; ``seconds`` is the step's wall time on the bench clock."""
        if self.prof is None:
            return
        try:
            self.prof.stop()
            self.breakdown = time_breakdown(self.prof.events(), self.device == "cuda", step_us=seconds * 1e6, steps=1)
        except Exception as exc:
            self.error = f"profiling the step failed: {exc!r}"
        self.prof = None
