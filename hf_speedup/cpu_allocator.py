"""Keep freed CPU memory for reuse (glibc ``mallopt``) so training steps stop page-faulting.

torch's CPU allocator is plain ``malloc``. glibc serves large blocks (activations, gradients, GEMM outputs)
with ``mmap`` and returns them to the kernel on ``free``; the next step's allocation of the same size gets
fresh pages, and every 4 KiB page is faulted in and zeroed by the kernel again. A compiled step, which
allocates its buffers in a different pattern from eager, measured about 10,000 page faults per step on the
embedded tiny Llama here. Raising ``M_MMAP_THRESHOLD`` (serve blocks from the heap) and ``M_TRIM_THRESHOLD``
(keep freed heap memory) makes steady-state steps reuse pages that are already mapped: no faults.

Trade-off: resident memory stays at the run's peak instead of shrinking between steps. The setting is
process-wide and lasts for the life of the process; it changes no numbers, only where memory comes from.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import resource

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB from the heap (older glibc refuse it: the fallback below)
MMAP_THRESHOLD_FALLBACK = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: accepted by every glibc
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes a C int: the largest value; keeps up to 2 GiB of free heap
PROBE_BYTES = 40 << 20  # above glibc's largest dynamic mmap threshold (32 MiB): by default always unmapped
_STATE: dict = {}


def unavailable_reason() -> str | None:
    """Why the setting cannot be applied in this process, or None when it can."""
    if platform.system() != "Linux":
        return f"needs glibc's mallopt; this is {platform.system()}"
    if platform.libc_ver()[0] != "glibc":
        return "needs glibc's mallopt; this Linux uses another C library (e.g. musl)"
    return None


def reuse_freed_memory() -> tuple[bool, str]:
    """Apply the two thresholds (idempotent). Returns (applied, what was set or why not)."""
    if "applied" in _STATE:
        return _STATE["applied"], _STATE["how"]
    why = unavailable_reason()
    if why is not None:
        _STATE.update(applied=False, how=why)
        return False, why
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mmap = MMAP_THRESHOLD if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 else MMAP_THRESHOLD_FALLBACK
    ok = mmap == MMAP_THRESHOLD or libc.mallopt(M_MMAP_THRESHOLD, mmap) == 1
    ok = ok and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    how = (f"glibc mallopt: M_MMAP_THRESHOLD={mmap >> 20} MiB, M_TRIM_THRESHOLD={(TRIM_THRESHOLD + 1) >> 30} GiB"
           if ok else "glibc refused mallopt(M_MMAP_THRESHOLD/M_TRIM_THRESHOLD)")
    _STATE.update(applied=ok, how=how)
    return ok, how


def reallocation_faults(nbytes: int = PROBE_BYTES, warm: int = 3, rounds: int = 3) -> tuple[int, int]:
    """Minor page faults when a freed ``nbytes`` tensor is allocated and written again, and the page count.

    With the default glibc a block this large is unmapped on ``free`` and every re-allocation faults on
    every page; with freed memory kept, it reuses mapped pages and faults (almost) never. ``warm`` rounds
    let the heap grow to size first; the fewest faults of ``rounds`` measured rounds count, so a heap that
    is still settling (right after the setting, with other allocations in between) does not read as "off".
    """
    import torch

    def once() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = torch.empty(nbytes // 4, dtype=torch.float32)
        t.fill_(1.0)
        del t
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    for _ in range(warm):
        once()
    return min(once() for _ in range(max(1, rounds))), nbytes // resource.getpagesize()
