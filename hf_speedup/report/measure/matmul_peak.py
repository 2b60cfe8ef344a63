"""This machine's own matmul peak: the FLOP/s of a large GEMM in the run's dtype, timed in process.

MFU divides by a datasheet peak, which a CPU has none of (it depends on cores, clocks, vector units and the
BLAS) and which a GPU reaches only in marketing conditions. The figure here is what this device, these
threads and this torch actually deliver on a GEMM large enough to sit at the plateau: the ceiling a training
step's matrix products could run at. The report states the step against it (``fraction_of_matmul_peak``)
beside MFU against the nominal peak.

- CPU: a 2048^3 GEMM (17 GFLOP: about 0.1 s at fp32 on a 2-core Zen 4) in the dtype, best of ``reps``
  after a warm-up; fp32 takes the faster of the default BLAS (MKL) and oneDNN's matmul where oneDNN stays
  exact (the choice ``compile``'s CPU GEMM autotune makes per shape); bf16 is a bf16 matmul (what autocast
  runs); ``tf32`` is not a CPU mode and is timed as fp32.
- CUDA: an 8192^3 GEMM (1.1 TFLOP), synchronised, best of ``reps``; ``tf32`` is an fp32 GEMM with TF32
  allowed, fp32 one with it disallowed.

Timed again at every run (about a second) and the best figure this machine has shown kept per device name,
threads, torch version, dtype and size (:func:`hf_speedup.measured.best`): a timing taken while other work
shared the machine cannot stick as its ceiling; ``HF_SPEEDUP_MEASURE=0`` (the test suite) measures nothing and
the figure is null, with that reason.
"""

from __future__ import annotations

import time
from typing import Callable

from ...dtypes import short_name
from ...measured import MEASURE_ENV, Measurement, best, measuring_enabled

KIND = "matmul_peak"
CPU_SIZE, CUDA_SIZE = 2048, 8192
REPS = 5


def gemm_size(device_type: str) -> int:
    return CUDA_SIZE if device_type == "cuda" else CPU_SIZE


def _torch_dtype(dtype: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)


def best_seconds(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    """The fastest of ``reps`` timed calls of ``fn`` after one untimed (warm-up) call."""
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def time_matmul_peak(device_type: str, dtype: str, size: int | None = None, reps: int = REPS) -> tuple[float, str]:
    """(FLOP/s of the best ``size``^3 GEMM in ``dtype`` on this device, which library / mode gave it)."""
    import torch

    from ...compat import set_tf32, tf32_matmul_state

    n = size or gemm_size(device_type)
    device = "cuda" if device_type == "cuda" else "cpu"
    tdtype = _torch_dtype(dtype)
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=tdtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=tdtype, generator=g)
    flops = 2.0 * n ** 3
    if device == "cuda":
        previous, wanted = tf32_matmul_state()[0], dtype == "tf32"
        if previous != wanted:
            set_tf32(wanted)
        try:
            seconds = best_seconds(lambda: torch.mm(a, b), reps, torch.cuda.synchronize)
        finally:
            if previous != wanted:
                set_tf32(previous)
        return flops / seconds, f"torch.mm ({'TF32' if dtype == 'tf32' else short_name(tdtype)})"
    candidates = {"torch.mm": lambda: torch.mm(a, b)}
    if tdtype == torch.float32:
        from ...features.compile.cpu_gemm import onednn_fp32_ok, onednn_mm

        if onednn_fp32_ok()[0]:
            candidates["oneDNN matmul"] = lambda: onednn_mm(a, b)
    timed = {name: best_seconds(fn, reps, lambda: None) for name, fn in candidates.items()}
    library = min(timed, key=timed.get)
    return flops / timed[library], library


def matmul_peak(device_type: str, device_name: str | None, dtype: str, threads: int | None = None,
                measure: Callable[..., tuple[float, str]] | None = None) -> tuple[float | None, str]:
    """(this machine's matmul peak FLOP/s for ``dtype``, what it is: the GEMM timed, where, cached or not);
    (None, why) when measuring is off or the device has no GEMM to time here."""
    import torch

    if not measuring_enabled():
        return None, f"matmul peak not measured ({MEASURE_ENV}=0)"
    if device_type not in ("cpu", "cuda"):
        return None, f"matmul peak not measured on {device_type} (CPU and CUDA only)"
    dtype = "fp32" if dtype == "tf32" and device_type != "cuda" else dtype
    threads = threads if threads is not None else torch.get_num_threads()
    n = gemm_size(device_type)
    where = f"{device_name or device_type}, {threads} threads, torch {torch.__version__}"
    timer = measure or time_matmul_peak

    def run() -> Measurement:
        flops, library = timer(device_type, dtype, n)
        return Measurement(float(flops), f"best {n}x{n}x{n} {dtype} GEMM ({library}, best of {REPS})", where)

    key = {"device": device_name or device_type, "threads": threads, "torch": torch.__version__, "dtype": dtype,
           "size": n}
    try:
        found = best(KIND, key, run)
    except Exception as exc:  # noqa: BLE001 - a failed timing must never end a run: the figure is unknown
        return None, f"matmul peak not measured ({exc!r})"
    return float(found.value), found.text()
