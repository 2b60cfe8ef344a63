"""Where a profiled step's time goes: the self time of its operators, sorted into buckets.

Every operator event of the profiled steps counts once, with its *self* time (its own time, its children's
left out: CPU time on a CPU, the time of the kernels it launched on CUDA), in the first bucket that takes it:

- ``optimizer``: anything inside the optimizer step (``Optimizer.step#...``, ``Optimizer.zero_grad#...``,
  the ``hf_speedup/optimizer_step`` label) or a fused/foreach optimizer kernel (``_fused_adamw``, ``_foreach_*``);
- ``data``: anything inside the data loader's ``enumerate(DataLoader)#...`` range (fetching and collating);
- ``matmul``: GEMMs (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``_grouped_mm``, oneDNN's ``hf_speedup::onednn_mm``,
  and the thin ``linear`` / ``matmul`` wrappers around them);
- ``attention``: ``scaled_dot_product*``, flash / efficient / cuDNN attention kernels, ``hf_speedup::sdpa_varlen*``,
  softmax (the eager attention path) and its backward, and everything inside ``hf_speedup::blocked_attention*``
  (the CPU kernel's GEMMs included: they are attention's time);
- ``loss``: ``cross_entropy``, ``log_softmax`` and ``nll_loss`` (forward and backward) and whatever else runs
  inside the ``hf_speedup/loss`` label other than a GEMM;
- ``compiled``: the self time of a compiled graph's call (``## Call CompiledFxGraph ... ##``: inductor's fused
  kernels run inside it without events of their own on a CPU: norms, activations, residual adds, fused); the
  wrappers around it (``Torch-Compiled Region``: guards; ``CompiledFunction``: AOT autograd's runtime) are
  overhead;
- ``elementwise``: every other operator (norms, activations, adds, copies, embedding, casts);
- ``overhead``: the step's wall time not inside any operator: Python, the Trainer loop, autograd's engine,
  hooks, dispatch (the self time of ranges such as ``ProfilerStep#``, ``autograd::engine::...``, labels).

The step is the ``ProfilerStep#`` range (from one ``prof.step()`` to the next: one whole loop iteration) or a
wall time the caller measured; figures are per step (the window's total over its steps). On a CPU the operator
buckets and the overhead add up to the step. On CUDA the buckets are device time and ``overhead`` is the
step's wall time the device spent idle (kernels of several streams may overlap; the sum is then clipped).
"""

from __future__ import annotations

BUCKETS = ("matmul", "attention", "loss", "optimizer", "data", "compiled", "elementwise", "overhead")
LABEL = "hf_speedup/"
STEP_RANGE = "ProfilerStep"
OPTIMIZER_RANGES = ("Optimizer.step#", "Optimizer.zero_grad#", LABEL + "optimizer_step")
DATA_RANGES = ("enumerate(DataLoader)",)
LOSS_RANGE = LABEL + "loss"
MATMUL_OPS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm", "_int_mm",
              "linear", "matmul", "_addmm_activation", "onednn_mm", "mkldnn_linear", "mkldnn_matmul"}
ATTENTION_MARKS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention",
                   "sdpa_varlen", "flash_attn", "blocked_attention")
ATTENTION_KERNELS = ("hf_speedup::blocked_attention", "hf_speedup_cpu::blocked_attention")  # their GEMMs count here
ATTENTION_OPS = {"softmax", "_softmax", "_softmax_backward_data", "_safe_softmax"}
LOSS_MARKS = ("cross_entropy", "log_softmax", "nll_loss")
OPTIMIZER_MARKS = ("_fused_adam", "_fused_sgd", "_foreach_")
COMPILED_MARKS = ("CompiledFxGraph",)
# ranges: their self time is the framework's (Python, autograd's engine, hooks), not an operator's
RANGE_MARKS = ("autograd::engine::", "torch::autograd::", "Backward0", "Backward1", "ProfilerStep", LABEL,
               "Optimizer.", "enumerate(DataLoader)", "cudaDeviceSynchronize", "cudaStreamSynchronize",
               "CompiledFunction", "Torch-Compiled Region")


def op_name(name: str) -> str:
    """``aten::mm`` -> ``mm``; ``hf_speedup::onednn_mm`` -> ``onednn_mm``."""
    return name.rsplit("::", 1)[-1]


def classify(name: str, ancestors: tuple[str, ...] = ()) -> str:
    """The bucket of one event's self time, from its name and the names of the ranges around it."""
    if any(a.startswith(OPTIMIZER_RANGES) for a in (*ancestors, name)) or any(m in name for m in OPTIMIZER_MARKS):
        return "optimizer"
    if any(a.startswith(DATA_RANGES) for a in (*ancestors, name)):
        return "data"
    if any(m in name for m in COMPILED_MARKS):
        return "compiled"
    if name.startswith(RANGE_MARKS) or any(m in name for m in RANGE_MARKS[:4]) or name.startswith("cuda"):
        return "overhead"
    if any(a.startswith(ATTENTION_KERNELS) for a in ancestors):
        return "attention"
    op = op_name(name)
    if op in MATMUL_OPS:
        return "matmul"
    if any(m in op for m in ATTENTION_MARKS) or op in ATTENTION_OPS:
        return "attention"
    if any(m in op for m in LOSS_MARKS) or LOSS_RANGE in ancestors:
        return "loss"
    return "elementwise"


def _ancestors(event) -> tuple[str, ...]:
    names = []
    parent = getattr(event, "cpu_parent", None)
    while parent is not None:
        names.append(parent.name)
        parent = getattr(parent, "cpu_parent", None)
    return tuple(names)


def time_breakdown(events, device: bool = False, step_us: float | None = None, steps: int | None = None) -> dict:
    """Per step, the microseconds (and share of the step) of each bucket, from profiler ``events``
    (``prof.events()``: each with ``name``, ``self_cpu_time_total``, ``self_device_time_total``, ``cpu_parent``).

    The step is the ``ProfilerStep#`` ranges' total over their number, unless the caller gives ``step_us`` (its
    own clock, over ``steps`` steps)."""
    key = "self_device_time_total" if device else "self_cpu_time_total"
    totals = {b: 0.0 for b in BUCKETS if b != "overhead"}
    step_ranges = [e for e in events if e.name.startswith(STEP_RANGE) and getattr(e, "cpu_parent", None) is None]
    for event in events:
        if event.name.startswith(STEP_RANGE):
            continue
        bucket = classify(event.name, _ancestors(event))
        if bucket != "overhead":
            totals[bucket] += float(getattr(event, key, 0.0) or 0.0)
    if step_us is None:
        steps = len(step_ranges)
        step_us = sum(float(e.cpu_time_total) for e in step_ranges)
    else:
        step_us, steps = float(step_us) * (steps or 1), steps or 1
    if not steps or step_us <= 0:
        return {"steps": 0, "reason": "no profiled step (no ProfilerStep# range in the window)"}
    busy = sum(totals.values())
    out = {b: v / steps for b, v in totals.items()}
    out["overhead"] = max(0.0, step_us - busy) / steps
    step = step_us / steps
    return {
        "steps": steps,
        "step_ms": round(step / 1e3, 3),
        "basis": ("device time of the kernels each operator launched; overhead = the step's wall time the device "
                  "was idle" if device else "self CPU time of each operator; overhead = the step's wall time "
                  "outside every operator (Python, the Trainer loop, autograd's engine, hooks)"),
        "buckets_ms": {b: round(out[b] / 1e3, 3) for b in BUCKETS},
        "buckets_percent": {b: round(100 * out[b] / step, 1) for b in BUCKETS},
        "clipped": busy > step_us,  # overlapping streams or threads: the buckets add up past the step
    }


def breakdown_lines(breakdown: dict) -> list[str]:
    """``matmul 61.2% (512.3 ms)`` per bucket, largest first (what the console prints)."""
    if not breakdown or not breakdown.get("steps"):
        return []
    pct, ms = breakdown["buckets_percent"], breakdown["buckets_ms"]
    order = sorted(BUCKETS, key=lambda b: -pct[b])
    return [f"{b} {pct[b]:.1f}% ({ms[b]:,.1f} ms)" for b in order if ms[b] > 0]
