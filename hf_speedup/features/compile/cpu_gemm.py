"""CPU GEMM autotuning for ``mode='max-autotune'``: each fp32 GEMM shape runs on MKL or oneDNN, whichever is faster.

inductor's own CPU GEMM templates only serve frozen (inference) weights, and the fp32 GEMMs are most of a small
model's training step; so a post-grad inductor pass (:func:`cpu_gemm_pass`) times every GEMM shape both ways once
per process and swaps the ``aten.mm`` nodes where oneDNN won for an opaque ``hf_speedup::onednn_mm`` op.
"""

from __future__ import annotations

import time

from ... import compat
from ...hardware import cpu_name
from .regions import _first_line


# --------------------------------------------------------------------------------------------- CPU GEMMs
# Measured on a 2-core AMD EPYC (Zen 4, no AMX): MKL runs the fp32 GEMMs of a small Llama at ~65% of peak,
# oneDNN's matmul 20-30% faster for most shapes. torch routes fp32 ``aten::mm`` to oneDNN only under
# ``fp32_precision = "bf16"``, which on CPUs without AMX still computes in fp32 (checked at run time by
# :func:`onednn_fp32_ok`; where oneDNN would really round to bf16 the autotune stays off). The flag is set
# around each chosen GEMM only: set globally it also reaches the small GEMMs inside SDPA's flash kernel,
# which then get 3x slower.

ONEDNN_MIN_GAIN = 0.05  # oneDNN must beat the default BLAS by 5% on a shape to be chosen
GEMM_CHOICES: dict[tuple, dict] = {}  # (sizes, strides) -> {"choice", "default_s", "onednn_s"}
GEMM_NODES = {"onednn": 0, "default": 0}  # mm nodes given to each library by the pass (this process)
GEMM_CALLS = [0]  # hf_speedup::onednn_mm calls run (this process)
_OP = None
_PASS = None


def _register_onednn_mm():
    """``hf_speedup::onednn_mm(a, b)``: ``torch.mm`` with oneDNN's matmul; opaque to inductor."""
    global _OP
    if _OP is None:
        import torch

        lib = torch.library.Library("hf_speedup", "FRAGMENT")
        lib.define("onednn_mm(Tensor a, Tensor b) -> Tensor")
        lib.impl("onednn_mm", onednn_mm, "CPU")
        lib.impl("onednn_mm", lambda a, b: a.new_empty((a.shape[0], b.shape[1])), "Meta")
        _register_onednn_mm.lib = lib  # the Library must outlive this call
        _OP = torch.ops.hf_speedup.onednn_mm.default
    return _OP


_PRECISION_API = None


def onednn_mm(a, b):
    global _PRECISION_API
    import torch

    if _PRECISION_API is None:
        _PRECISION_API = compat.mkldnn_matmul_precision_api()
    get, set_ = _PRECISION_API
    GEMM_CALLS[0] += 1
    previous = get()
    set_("bf16")
    try:
        return torch.mm(a, b)
    finally:
        set_(previous)


def onednn_fp32_ok() -> tuple[bool, str]:
    """oneDNN matmul reachable, and as exact as fp32 here (error vs fp64 within 4x of the default BLAS)."""
    import torch

    if compat.mkldnn_matmul_precision_api() is None:
        return False, f"torch {torch.__version__} cannot route fp32 matmuls to oneDNN (no fp32_precision API)"
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 512, generator=g), torch.randn(512, 256, generator=g)
    exact = a.double() @ b.double()
    err_default = (torch.mm(a, b).double() - exact).abs().max().item()
    try:
        err_onednn = (onednn_mm(a, b).double() - exact).abs().max().item()
    except RuntimeError as exc:  # e.g. a CPU/oneDNN build that refuses the precision setting
        return False, f"oneDNN matmul could not run here ({_first_line(exc)})"
    if err_onednn > 4 * err_default + 1e-6:
        return False, (f"oneDNN would round fp32 GEMMs to bf16 on this CPU (error {err_onednn:.1e} vs "
                       f"{err_default:.1e}); use precision bf16 instead")
    return True, "oneDNN matmul computes in fp32 here"


def cpu_gemm_pass():
    """The post-grad inductor pass that picks MKL or oneDNN per GEMM shape (one instance: stable cache key)."""
    global _PASS
    if _PASS is None:
        from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

        class CpuGemmChoice(CustomGraphPass):
            """Swap ``aten.mm`` nodes for ``hf_speedup::onednn_mm`` where oneDNN measured faster."""

            def __call__(self, graph) -> None:
                choose_cpu_gemms(graph)

            def uuid(self):
                return (get_hash_for_files((__file__,)), cpu_name())

        _register_onednn_mm()
        _PASS = CpuGemmChoice()
    return _PASS


def choose_cpu_gemms(graph) -> None:
    import torch

    op = _register_onednn_mm()
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.mm.default:
            continue
        choice = _gemm_choice(*(arg.meta.get("val") for arg in node.args[:2]))
        GEMM_NODES[choice] += 1
        if choice == "onednn":
            node.target = op


def _gemm_choice(a, b) -> str:
    """Benchmark this exact GEMM (sizes, strides) both ways once per process; 'default' when unsure."""
    import torch

    if not all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu" for t in (a, b)):
        return "default"
    try:
        key = tuple((tuple(int(x) for x in t.shape), tuple(int(x) for x in t.stride())) for t in (a, b))
    except (TypeError, ValueError):  # symbolic sizes (dynamic shapes): nothing concrete to measure
        return "default"
    if key not in GEMM_CHOICES:
        GEMM_CHOICES[key] = benchmark_gemm(key)
    return GEMM_CHOICES[key]["choice"]


def benchmark_gemm(key: tuple, reps: int = 7) -> dict:
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        a, b = (torch.empty_strided(size, stride).normal_() for size, stride in key)
        times = {}
        for name, fn in (("default", torch.mm), ("onednn", onednn_mm), ("default", torch.mm), ("onednn", onednn_mm)):
            fn(a, b)
            best = min(_timed(fn, a, b) for _ in range(reps))
            times[name] = min(best, times.get(name, best))
    choice = "onednn" if times["onednn"] < (1 - ONEDNN_MIN_GAIN) * times["default"] else "default"
    return {"choice": choice, "default_s": times["default"], "onednn_s": times["onednn"]}


def _timed(fn, a, b) -> float:
    start = time.perf_counter()
    fn(a, b)
    return time.perf_counter() - start


def cpu_gemm_summary() -> str:
    n = GEMM_NODES["onednn"] + GEMM_NODES["default"]
    chosen = (f"oneDNN chosen for {GEMM_NODES['onednn']}/{n} GEMM nodes (autotuned per shape vs the default BLAS)"
              if n else "GEMM choices loaded from inductor's cache (autotuned by an earlier run)")
    return f"{chosen}, {GEMM_CALLS[0]} oneDNN GEMM calls run so far"
