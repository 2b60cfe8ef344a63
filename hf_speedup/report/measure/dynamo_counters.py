"""Compile statistics read from dynamo's own counters (host-side, nothing imported when dynamo never ran):
compile seconds, frames, recompiles, graph breaks, and which modules run compiled."""

from __future__ import annotations

import sys
from typing import Any


def compile_seconds() -> float:
    """Dynamo's compile seconds so far in this process (``dynamo_snapshot()["compile_seconds"]``, cheaper: read at
    every phase boundary of the report's time split)."""
    if "torch._dynamo" not in sys.modules:
        return 0.0
    try:
        from torch._dynamo import utils as dutils

        times = getattr(dutils, "compilation_time_metrics", {}) or {}
        return float(sum(times.get("_compile.compile_inner", ())) + sum(times.get("backward._backward_impl", ())))
    except Exception:  # pragma: no cover - internals moved
        return 0.0


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
