"""Memory figures of a run: allocator peaks (peak RSS on CPU), the estimate for the largest batch seen and,
on request, one step's live-tensor peak under torch's MemTracker."""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

from .dynamo_counters import compiled_regions


def _accelerator_module(device_type: str):
    import torch

    mod = getattr(torch, device_type, None) if device_type in ("cuda", "xpu", "mps") else None
    if mod is not None and hasattr(mod, "max_memory_allocated"):
        return mod
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


_PROCESS: dict = {}


def current_rss_bytes() -> int:
    try:
        import psutil

        pid = os.getpid()
        proc = _PROCESS.get(pid) or _PROCESS.setdefault(pid, psutil.Process(pid))
        return int(proc.memory_info().rss)
    except Exception:  # pragma: no cover - psutil is a dependency, /proc is the fallback
        try:
            with open("/proc/self/statm") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0


def memory_source(device_type: str) -> str:
    return f"{device_type} caching allocator" if _accelerator_module(device_type) else "process peak RSS"


def reset_peak_memory(device_type: str, device: Any = None) -> None:
    mod = _accelerator_module(device_type)
    if mod is not None and hasattr(mod, "reset_peak_memory_stats"):
        try:
            mod.reset_peak_memory_stats(device) if device is not None else mod.reset_peak_memory_stats()
        except Exception:  # e.g. not initialised yet
            pass


def memory_snapshot(device_type: str, device: Any = None) -> dict:
    """Allocator peaks on an accelerator (reserved = what nvidia-smi shows); peak RSS on CPU.

    Host-side queries of allocator statistics: no device synchronisation.
    """
    mod = _accelerator_module(device_type)
    if mod is not None:
        args = () if device is None else (device,)
        try:
            return {
                "peak_memory_allocated_bytes": int(mod.max_memory_allocated(*args)),
                "peak_memory_reserved_bytes": int(getattr(mod, "max_memory_reserved", mod.max_memory_allocated)(*args)),
                "memory_allocated_bytes": int(mod.memory_allocated(*args)),
            }
        except Exception:
            pass
    now = current_rss_bytes()  # before the peak, so that peak >= now
    peak = max(peak_rss_bytes(), now)
    return {"peak_memory_allocated_bytes": peak, "peak_memory_reserved_bytes": peak, "memory_allocated_bytes": now}


def memory_measures(device_type: str, live: dict | None, estimate: dict | None) -> dict:
    """What each memory number of the report is (``measurement["memory_measures"]``)."""
    from ...memory_model import fmt_bytes

    if _accelerator_module(device_type):
        out = {"peak_memory_allocated_bytes": f"torch.{device_type}.max_memory_allocated: the peak of live tensors",
               "peak_memory_reserved_bytes": (f"torch.{device_type}.max_memory_reserved: what the caching allocator "
                                              "held (the device shows this plus the context)")}
    else:
        rss = ("process peak RSS (ru_maxrss): the Python runtime, libraries and every page malloc kept, not live "
               f"tensors ({device_type} has no allocator statistics)")
        out = {"peak_memory_allocated_bytes": rss, "peak_memory_reserved_bytes": rss}
    out["peak_live_tensor_bytes"] = (
        f"torch MemTracker over step {live['step']}: the peak of live tensor bytes" if live and live.get("bytes")
        else "not measured" + (f": {live['reason']}" if live and live.get("reason") else
                               " (memory.track_live_tensors: true measures one step)"))
    out["estimated_peak_bytes"] = (
        f"hf_speedup.estimate_memory for this plan, micro-batch {estimate['micro_batch']} x {estimate['seq_len']} "
        "tokens (the largest seen): live tensors at the peak" if estimate else "not estimated (model not sized)")
    out["estimated_bytes_per_token"] = (
        f"what the plan expects each token of the micro-batch to add (slope between rows of "
        f"{max(1, estimate['seq_len'] // 2)} and {estimate['seq_len']} tokens); "
        f"{fmt_bytes(estimate['constant_bytes'])} at 0 tokens" if estimate else "not estimated (model not sized)")
    return out


class LiveTensorStep:
    """One training step under torch's ``MemTracker`` (a dispatch mode: that step runs slower).

    ``begin`` at the step's start, ``next_micro_batch`` before each micro-batch after the first (the tracker
    counts one forward per module otherwise), ``end`` after the optimizer step and ``zero_grad``.
    """

    def __init__(self) -> None:
        self.tracker = None
        self.result: dict | None = None

    def begin(self, model, optimizer, step: int) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        for p in model.parameters():  # MemTracker hooks every parameter; frozen ones (LoRA's base) cannot take one
            if not p.requires_grad:
                tracker._param_to_grad_hook_handles[p] = (NoHook(), NoHook())
        tracker.track_external(model, *([optimizer] if optimizer is not None else []))
        tracker.__enter__()
        self.tracker, self.step, self.micro_batches = tracker, step, 0

    def next_micro_batch(self) -> None:
        if self.tracker is not None:
            if self.micro_batches:
                self.tracker.reset_mod_stats()
            self.micro_batches += 1

    def end(self) -> dict | None:
        tracker, self.tracker = self.tracker, None
        if tracker is None:
            return self.result
        tracker.__exit__(None, None, None)
        peak = tracker.get_tracker_snapshot("peak")
        if peak:
            device, snap = max(peak.items(), key=lambda kv: kv[1].get("Total", 0))
            names = {k: str(getattr(k, "value", k)) for k in snap}  # "Parameter", "Gradient", ... and "Total"
            by = {names[k]: int(v) for k, v in snap.items() if names[k] != "Total"}
            self.result = {"step": self.step, "bytes": int(snap.get("Total", 0)), "device": str(device),
                           "by_category": {k: v for k, v in by.items() if v}}
        return self.result


class NoHook:
    """A hook handle that removes nothing: what MemTracker is given for a frozen parameter, which cannot take the
    gradient hook it puts on every parameter."""

    def remove(self) -> None:
        pass


def blocks_fell_back(model: Any) -> bool:
    """A compiled region of ``model`` runs eager after a failed compile (its activations are eager's then)."""
    modules = model.modules() if hasattr(model, "modules") else ()
    return any(getattr(getattr(m, "_compiled_call_impl", None), "fallback_reason", None) for m in modules)


def estimated_peak(plan: Any, micro_batch: int, seq_len: int, grad_accum: int = 1, padded: bool = False,
                   eager_blocks: bool = False) -> dict | None:
    """:mod:`hf_speedup.memory_model`'s peak for this plan and a batch shape (None where the model is not sized);
    ``eager_blocks``: planned compiled blocks that fell back to eager are estimated as eager."""
    from ...features.memory.budget import training_setup
    from ...memory_model import estimate

    shape = getattr(plan.model, "shape", None)
    if shape is None or not micro_batch or not seq_len:
        return None
    from ...estimate import per_token

    setup = training_setup(plan.decisions, shape, plan.caps, micro_batch=micro_batch, seq_len=seq_len,
                           grad_accum=grad_accum, padded=padded)
    setup = setup.replace(compiled=False) if eager_blocks else setup
    est = estimate(shape, setup)
    # what the plan expects each further token to cost, and the rest (the slope between half this length and it)
    slope, constant = per_token(lambda n: estimate(shape, setup.replace(seq_len=n)).total_bytes, seq_len, micro_batch)
    return {"bytes": est.total_bytes, "peak_tensor_bytes": est.peak_tensor_bytes, "peak_phase": est.peak_phase,
            "breakdown": est.breakdown, "micro_batch": micro_batch, "seq_len": seq_len, "padded": padded,
            "bytes_per_token": round(slope, 1), "constant_bytes": int(constant)}


class MemoryWatch:
    """The report's memory figures beyond the allocator's: the estimate for the largest batch seen (free) and,
    with ``memory.track_live_tensors``, the live-tensor peak of one step (the second, when optimizer states
    exist; that step is left out of the timing)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        settings = getattr(trainer.speedup_plan.decisions.get("memory"), "settings", None)
        self.track = bool(getattr(settings, "track_live_tensors", False))
        self.live = LiveTensorStep()
        self.rows = self.seq = self.slots = 0
        self.reason: str | None = None

    def batch(self, inputs: Any) -> None:
        """A micro-batch's shape (host-side, no device access)."""
        ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
        shape = getattr(ids, "shape", ())
        if len(shape) == 2:
            self.rows, self.seq = max(self.rows, int(shape[0])), max(self.seq, int(shape[1]))
            self.slots += int(shape[0]) * int(shape[1])
        self.live.next_micro_batch()

    def step_begin(self, state: Any) -> None:
        if not self.track or self.live.result is not None or self.live.tracker is not None or self.reason:
            return
        if state.global_step != (1 if (state.max_steps or 0) > 1 else 0):
            return
        trainer = self.trainer
        if compiled_regions(trainer.model):
            self.reason = "compiled regions run here: a dispatch mode would make them recompile or run eagerly"
            return
        try:
            from ...compat import unwrap_optimizer

            opt = getattr(trainer, "optimizer", None)
            self.live.begin(trainer.model, unwrap_optimizer(opt) if opt is not None else None, state.global_step + 1)
        except Exception as exc:  # measuring must never stop training
            self.reason = f"MemTracker could not start: {exc!r}"

    def step_end(self) -> bool:
        """True when the step that just ended was tracked (it ran slower)."""
        if self.live.tracker is None:
            return False
        try:
            self.live.end()
        except Exception as exc:
            self.reason = f"MemTracker failed: {exc!r}"
        return True

    def summary(self, tokens: int, grad_accum: int, device_type: str) -> tuple[int | None, dict]:
        """(estimated peak bytes, measurement entries)."""
        padded = bool(self.slots) and tokens < self.slots
        est = estimated_peak(self.trainer.speedup_plan, self.rows, self.seq, grad_accum, padded,
                             eager_blocks=blocks_fell_back(self.trainer.model))
        live = self.live.result or ({"reason": self.reason} if self.reason else None)
        return (est["bytes"] if est else None), {
            "live_tensor_peak": live, "memory_estimate": est,
            "peak_live_tensor_bytes": live.get("bytes") if live else None,
            "memory_measures": memory_measures(device_type, live, est)}
