"""What a training run achieved: tokens, FLOPs and MFU, memory, compile statistics.

Pure helpers (unit-tested against hand-computed numbers) plus small readers of torch's own counters.
Nothing here synchronises a device: token counts stay on the device until the caller reads them at a
point where the Trainer synchronises anyway (a logging step).

Definitions (DESIGN.md, "Metric definitions"):

- Tokens: ``attention_mask == 1`` (2-D masks), else the sequences of a padding-free row (``position_ids``
  restarting at 0 and no mask; padding after the last sequence left out), else ``labels != -100``, else
  every input id. Padding is not work. Summed over ranks. Samples are sequences: rows, or each sequence
  of a padding-free row.
- FLOPs per token (dense decoder, PaLM convention, per *non-padding* token)::

      4 * N_frozen + 6 * N_trainable + 12 * L * H * S

  with ``N`` counting matmul weights only (embedding lookups excluded; a tied output head is counted
  once as a matmul), ``N_frozen = 0`` for a full fine-tune (giving the familiar ``6 N + 12 L H S``),
  ``L`` layers, ``H`` the attention width (heads x head_dim, = hidden size for Llama-style models) and
  ``S`` the token-weighted mean sequence length ``sum(L_i^2) / sum(L_i)`` (each token attends over its own
  sequence; the plain mean under-counts ragged batches, and a padding-free row is its sequences). Recomputation by activation checkpointing is *not*
  counted: this is MFU, not HFU.
- MFU = FLOPs per token x tokens/s (all ranks) / (peak dense FLOP/s of the dtype in use x devices).
"""

from __future__ import annotations

import os
import resource
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Sequence
from ..._version import __version__
from ...compat import tf32_matmul_enabled
from ...dtypes import short_name

IGNORE_INDEX = -100


# ------------------------------------------------------------------------------------------ tokens
COUNTS = ("tokens", "samples", "attended_tokens", "attended_squares")


def _get(batch, key):
    return batch.get(key) if hasattr(batch, "get") else None


def _segment_ends(position_ids):
    """Where each sequence of a padding-free row ends (bool, same shape), padding left out.

    A sequence restarts at ``position_ids == 0``; after the last non-zero position only zeros follow, which is
    how a padded padding-free row (TRL's ``pad_to_multiple_of``) pads: those are not sequences. A real final
    sequence of one token is counted as padding too: it has no target and next to no work.
    """
    import torch

    length = position_ids.shape[-1]
    index = torch.arange(length, device=position_ids.device)
    last = torch.where(position_ids != 0, index, -1).amax(-1, keepdim=True)
    last = torch.where(last < 0, length - 1, last)  # only one-token sequences: all of them real
    next_starts = torch.ones_like(position_ids, dtype=torch.bool)
    next_starts[..., :-1] = position_ids[..., 1:] == 0
    return (index <= last) & (next_starts | (index == last))


def batch_counts(batch: dict) -> Any:
    """(tokens, sequences, attended tokens, sum of squared sequence lengths) of one (micro-)batch of this rank,
    a 4-element int64 tensor on the batch's device: no ``.item()``, no boolean indexing, so no sync.

    Tokens are the work: ``attention_mask == 1`` (2-D masks); else the sequences of a padding-free row
    (``position_ids`` restarting at 0, padding after the last sequence left out); else ``labels != -100``;
    else every input id. Sequence lengths are what attention spans: each sequence of a padding-free row on
    its own, else the non-padding length of each row; their squares give attention's FLOPs.
    """
    import torch

    mask, ids, labels = _get(batch, "attention_mask"), _get(batch, "input_ids"), _get(batch, "labels")
    positions = _get(batch, "position_ids")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        lengths = (mask != 0).sum(-1, dtype=torch.int64)
        return torch.stack([lengths.sum(), (lengths > 0).sum(), lengths.sum(), (lengths * lengths).sum()])
    if isinstance(positions, torch.Tensor) and positions.dim() == 2 and isinstance(ids, torch.Tensor):
        ends = _segment_ends(positions)
        lengths = (positions.to(torch.int64) + 1) * ends
        return torch.stack([lengths.sum(), ends.sum(), lengths.sum(), (lengths * lengths).sum()])
    rows = next((t for t in (ids, labels, _get(batch, "inputs_embeds")) if isinstance(t, torch.Tensor)
                 and t.dim() >= 2), None)
    if rows is None:
        return torch.zeros(4, dtype=torch.int64)
    n, length = rows.shape[0], rows.shape[1]
    tokens = torch.count_nonzero(labels != IGNORE_INDEX) if isinstance(labels, torch.Tensor) else \
        torch.tensor(n * length, device=rows.device)
    sizes = torch.tensor([n, n * length, n * length * length], dtype=torch.int64, device=rows.device)
    return torch.cat([tokens.reshape(1).to(torch.int64), sizes])


class TokenCounter:
    """Running ``COUNTS`` of this rank.

    Each micro-batch's counts stay a small device tensor in a pending list (a few reduction kernels per
    micro-batch, no sync); the list is folded into the total only when someone reads it.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._total = None  # 4-element int64 tensor
        self._pending: list = []

    def add(self, batch: dict) -> None:
        self._pending.append(batch_counts(batch))

    def totals_tensor(self, device=None):
        """The ``COUNTS`` totals as one int64 tensor (on ``device`` if given); reading it is the caller's sync."""
        import torch

        if self._pending:
            dev = self._total.device if self._total is not None else self._pending[0].device
            parts = [p.to(dev, dtype=torch.int64) for p in self._pending]
            if self._total is not None:
                parts.append(self._total)
            self._total = torch.stack(parts).sum(0)
            self._pending = []
        if self._total is None:
            return torch.zeros(len(COUNTS), dtype=torch.int64, device=device)
        return self._total if device is None else self._total.to(device)

    def tokens_tensor(self, device=None):
        return self.totals_tensor(device)[0]

    @property
    def samples(self) -> int:
        return int(self.totals_tensor()[1])


# Per-rank vector exchanged at logging steps: one small gather, summed or maxed per field.
RANK_FIELDS = COUNTS + ("peak_memory_allocated_bytes", "peak_memory_reserved_bytes", "memory_allocated_bytes")
_SUMMED = set(COUNTS)


def aggregate_ranks(rows: Sequence[Sequence[float]]) -> dict:
    """Combine per-rank vectors (``RANK_FIELDS`` order): the counts are summed over ranks, memory is the
    maximum (the rank that needs the most decides whether a run fits)."""
    if not rows:
        return {k: 0 for k in RANK_FIELDS}
    out = {}
    for i, key in enumerate(RANK_FIELDS):
        col = [int(r[i]) for r in rows]
        out[key] = sum(col) if key in _SUMMED else max(col)
    return out


def attention_length(attended_tokens: int, attended_squares: int) -> float | None:
    """``S`` of the FLOPs formula: the token-weighted mean sequence length, sum(L_i^2) / sum(L_i). Each token
    attends over its own sequence, so a batch of lengths 100 and 10 costs what lengths of ~91 would, not 55,
    and a padding-free row of 8 sequences costs what they cost apart, not what one row of their total would."""
    return attended_squares / attended_tokens if attended_tokens else None


# --------------------------------------------------------------------------------------- parameters
def attention_dims(model) -> tuple[int | None, int | None]:
    """(layers L, attention width H) from the model's (text) config; (None, None) when unknown."""
    cfg = getattr(model, "config", None)
    if cfg is None and hasattr(model, "get_base_model"):
        cfg = getattr(model.get_base_model(), "config", None)
    if cfg is None:
        return None, None
    if hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    layers = getattr(cfg, "num_hidden_layers", None)
    hidden = getattr(cfg, "hidden_size", None)
    heads = getattr(cfg, "num_attention_heads", None)
    head_dim = getattr(cfg, "head_dim", None)
    width = heads * head_dim if isinstance(heads, int) and isinstance(head_dim, int) else hidden
    return layers, width


# ----------------------------------------------------------------------------------------- FLOPs/MFU
def flops_per_token(matmul_trainable: int, matmul_frozen: int = 0, num_layers: int | None = 0,
                    attention_width: int | None = 0, seq_len: float | None = 0) -> float:
    """Training FLOPs per non-padding token: ``4*N_frozen + 6*N_trainable + 12*L*H*S``.

    Forward is 2 FLOPs per weight; backward is 2 for the activation gradient plus 2 for the weight
    gradient, which frozen weights skip. Attention (QK^T and AV, forward 4*H*S per layer and token)
    has no weights and is always fully back-propagated. Recomputation is not counted.
    """
    attn = 12 * (num_layers or 0) * (attention_width or 0) * (seq_len or 0)
    return float(4 * matmul_frozen + 6 * matmul_trainable + attn)


def mfu(tokens_per_second: float | None, flops_per_tok: float | None, peak_flops_per_device: float | None,
        num_devices: int = 1) -> float | None:
    """Model FLOPs utilisation in [0, 1]; None when the peak (or the throughput) is unknown."""
    if not tokens_per_second or not flops_per_tok or not peak_flops_per_device or num_devices < 1:
        return None
    return flops_per_tok * tokens_per_second / (peak_flops_per_device * num_devices)


def compute_dtype(args: Any = None, model: Any = None, device_type: str = "cpu") -> str:
    """The dtype the matmuls run in: bf16/fp16 (autocast or weights), tf32 (CUDA fp32 with TF32), fp32."""
    if args is not None and getattr(args, "bf16", False):
        return "bf16"
    if args is not None and getattr(args, "fp16", False):
        return "fp16"
    if model is not None:
        weights = next((short_name(p.dtype) for p in model.parameters() if p.is_floating_point()), "fp32")
        if weights in ("bf16", "fp16"):
            return weights
    if device_type == "cuda" and tf32_matmul_enabled():  # read as inductor reads it (both torch APIs)
        return "tf32"
    return "fp32"


# -------------------------------------------------------------------------------------------- memory
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
                tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
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


class _NoHook:
    def remove(self) -> None:
        pass


def estimated_peak(plan: Any, micro_batch: int, seq_len: int, grad_accum: int = 1, padded: bool = False) -> dict | None:
    """:mod:`hf_speedup.memory_model`'s peak for this plan and a batch shape (None where the model is not sized)."""
    from ...features.memory_budget import training_setup
    from ...memory_model import estimate

    shape = getattr(plan.model, "shape", None)
    if shape is None or not micro_batch or not seq_len:
        return None
    est = estimate(shape, training_setup(plan.decisions, shape, plan.caps, micro_batch=micro_batch, seq_len=seq_len,
                                         grad_accum=grad_accum, padded=padded))
    return {"bytes": est.total_bytes, "peak_tensor_bytes": est.peak_tensor_bytes, "peak_phase": est.peak_phase,
            "breakdown": est.breakdown, "micro_batch": micro_batch, "seq_len": seq_len, "padded": padded}


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
        est = estimated_peak(self.trainer.speedup_plan, self.rows, self.seq, grad_accum, padded)
        live = self.live.result or ({"reason": self.reason} if self.reason else None)
        return (est["bytes"] if est else None), {
            "live_tensor_peak": live, "memory_estimate": est,
            "peak_live_tensor_bytes": live.get("bytes") if live else None,
            "memory_measures": memory_measures(device_type, live, est)}


# ------------------------------------------------------------------------------------------- compile
def dynamo_snapshot() -> dict:
    """Cumulative compile counters of this process (diff two snapshots for one run).

    - ``compile_seconds``: dynamo's own timers: frame compiles (``_compile.compile_inner``, which
      includes the backend/inductor) plus lazily compiled backward graphs (``backward._backward_impl``);
    - ``frames``: frames dynamo compiled; ``recompiles``: compiles of a frame beyond its first;
    - ``graph_breaks``: graph breaks met while tracing (``counters['graph_break']``).
    """
    out = {"compile_seconds": 0.0, "frames": 0, "recompiles": 0, "graph_breaks": 0}
    mods = sys.modules
    if "torch._dynamo" not in mods:  # dynamo never imported: nothing was compiled
        return out
    try:
        from torch._dynamo import utils as dutils

        times = getattr(dutils, "compilation_time_metrics", {}) or {}
        fwd = times.get("_compile.compile_inner", [])
        bwd = times.get("backward._backward_impl", [])
        out["compile_seconds"] = float(sum(fwd) + sum(bwd))
        counters = dutils.counters
        out["frames"] = int(counters["frames"]["total"]) if "frames" in counters else 0
        out["graph_breaks"] = int(sum(counters["graph_break"].values())) if "graph_break" in counters else 0
    except Exception:  # pragma: no cover - internals moved
        return out
    try:
        from torch._dynamo import convert_frame

        per_frame = getattr(convert_frame, "FRAME_COMPILE_COUNTER", None)
        if per_frame is not None:
            out["recompiles"] = int(sum(max(0, c - 1) for c in per_frame.values()))
    except Exception:  # pragma: no cover
        pass
    return out


def compile_events() -> int:
    """A cheap number that grows whenever dynamo compiles anything (forward frame or backward graph)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    try:
        from torch._dynamo import utils as dutils

        times = dutils.compilation_time_metrics
        return (len(times.get("_compile.compile_inner", ())) + len(times.get("backward._backward_impl", ()))
                + int(dutils.counters["frames"]["total"]))
    except Exception:  # pragma: no cover
        return 0


def dynamo_diff(before: dict, after: dict) -> dict:
    keys = ("compile_seconds", "frames", "recompiles", "graph_breaks")
    return {k: (after.get(k, 0) - before.get(k, 0)) for k in keys}


def compiled_regions(*models: Any) -> int:
    """Modules that run compiled: ``torch.compile`` wrappers (OptimizedModule) and modules compiled in
    place with ``nn.Module.compile()``; each counted once across ``models``."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except Exception:  # pragma: no cover
        OptimizedModule = ()  # type: ignore[assignment]
    seen: set[int] = set()
    n = 0
    for root in models:
        if root is None or not hasattr(root, "modules"):
            continue
        for m in root.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            wrapped = bool(OptimizedModule) and isinstance(m, OptimizedModule)
            impl = getattr(m, "_compiled_call_impl", None)  # hf_speedup's guarded regions say if they run compiled
            if wrapped or (impl is not None and getattr(impl, "running_compiled", True)):
                n += 1
    return n


# --------------------------------------------------------------------------------------- step times
def steady_state_step_time(step_times: Sequence[float], warmup: Iterable[int] = ()) -> tuple[float | None, int]:
    """(median step time over steady-state steps, how many steps that is).

    ``warmup`` holds indices into ``step_times`` to exclude (the first step, steps that compiled).
    If every step is warm-up (a very short run), the median of all steps is returned.
    """
    if not step_times:
        return None, 0
    skip = set(warmup)
    steady = [t for i, t in enumerate(step_times) if i not in skip]
    if not steady:
        return float(statistics.median(step_times)), 0
    return float(statistics.median(steady)), len(steady)


class BoundedSeries:
    """Keeps at most ``max_len`` items of an append-only series by halving its resolution when full
    (every other item is dropped and from then on only every 2nd, 4th, ... new item is kept)."""

    def __init__(self, max_len: int = 1024) -> None:
        self.max_len = max(2, int(max_len))
        self.items: list = []
        self.stride = 1
        self._seen = 0

    def append(self, item) -> None:
        if self._seen % self.stride == 0:
            self.items.append(item)
            if len(self.items) > self.max_len:
                self.items = self.items[::2]
                self.stride *= 2
        self._seen += 1

    def __len__(self) -> int:
        return len(self.items)


# -------------------------------------------------------------------------------------- environment
def package_versions() -> dict:
    from importlib import metadata

    out = {}
    for name in ("torch", "transformers", "accelerate", "peft", "bitsandbytes", "datasets", "wandb"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def environment(caps: Any = None) -> dict:
    """Versions and the device, for the report's ``environment`` section."""
    import platform

    import torch

    env = {"hf_speedup": __version__, **package_versions(), "python": platform.python_version(),
           "cuda": getattr(torch.version, "cuda", None), "platform": platform.platform(terse=True)}
    if caps is not None:
        env.update(device_type=caps.device_type, device=caps.device, device_reason=caps.device_reason,
                   device_name=caps.device_name, device_count=caps.device_count, world_size=caps.world_size)
    return env
