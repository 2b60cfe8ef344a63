"""Peak dense FLOP/s by device name and dtype, the denominator of MFU.

Vendor datasheet numbers for *dense* math (no 2:4 sparsity), per device. For GeForce cards the
bf16/fp16 number is the one with FP32 accumulation (what PyTorch autocast uses), which is half the
FP16-accumulate figure. Unknown devices give ``None`` so MFU is reported as null rather than guessed;
a user override (``HF_SPEEDUP_PEAK_FLOPS=<FLOP/s per device>``) wins over the table.
"""

from __future__ import annotations

import os
import re

from .dtypes import short_name

OVERRIDE_ENV = "HF_SPEEDUP_PEAK_FLOPS"

_H100_SXM = {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}
_NVL = {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12}  # H100 NVL and H200 NVL (PCIe cards)

# (name key, lower-case) -> {dtype: FLOP/s}. A key matches ``torch.cuda.get_device_name()`` (lower-cased)
# as a whole word: "a10" does not match "a100", "l4" does not match "l40s", "h200" does not match "gh200".
# Order matters where keys overlap as words ("h100 nvl" before "h100"): the first match wins.
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("gh200", _H100_SXM),
    ("h200 nvl", _NVL),
    ("h200", _H100_SXM),
    ("h100 nvl", _NVL),
    ("h100 pcie", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("h100", _H100_SXM),  # SXM ("NVIDIA H100 80GB HBM3")
    ("h800", _H100_SXM),
    ("h20", {"bf16": 148e12, "fp16": 148e12, "tf32": 74e12, "fp32": 44e12}),
    ("gb200", {"bf16": 2500e12, "fp16": 2500e12, "tf32": 1250e12, "fp32": 80e12}),
    ("b200", {"bf16": 2250e12, "fp16": 2250e12, "tf32": 1100e12, "fp32": 80e12}),
    ("a100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("a800", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("a30", {"bf16": 165e12, "fp16": 165e12, "tf32": 82e12, "fp32": 10.3e12}),
    ("a40", {"bf16": 149.7e12, "fp16": 149.7e12, "tf32": 74.8e12, "fp32": 37.4e12}),
    ("l40s", {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("l40", {"bf16": 181e12, "fp16": 181e12, "tf32": 90.5e12, "fp32": 90.5e12}),
    ("l4", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("a10g", {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 31.2e12}),
    ("a10", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("rtx 6000 ada", {"bf16": 364.2e12, "fp16": 364.2e12, "tf32": 182.1e12, "fp32": 91.1e12}),
    ("rtx a6000", {"bf16": 154.8e12, "fp16": 154.8e12, "tf32": 77.4e12, "fp32": 38.7e12}),
    ("rtx 4090", {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12}),
    ("rtx 3090", {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12}),
    ("v100", {"fp16": 125e12, "fp32": 15.7e12}),
    ("t4", {"fp16": 65e12, "fp32": 8.1e12}),
    ("mi325x", {"bf16": 1307e12, "fp16": 1307e12, "fp32": 163.4e12}),
    ("mi300x", {"bf16": 1307e12, "fp16": 1307e12, "fp32": 163.4e12}),
    ("mi250x", {"bf16": 383e12, "fp16": 383e12, "fp32": 47.9e12}),
]

def normalize_dtype(dtype) -> str:
    """``'bfloat16'``, ``torch.bfloat16``, ``'bf16'`` -> ``'bf16'``; ``'tf32'`` stays (a matmul mode, not a dtype)."""
    return short_name(dtype.lower() if isinstance(dtype, str) else dtype)


def _matches(key: str, name: str) -> bool:
    return re.search(rf"(?<![a-z0-9]){re.escape(key)}(?![a-z0-9])", name) is not None


def peak_flops_for(device_name: str | None, dtype: str, override: float | None = None) -> float | None:
    """Peak dense FLOP/s for ``dtype`` on ``device_name``; ``override`` (user-given) wins."""
    if override is not None:
        return float(override)
    if not device_name:
        return None
    name = device_name.lower()
    for key, table in PEAK_FLOPS:
        if _matches(key, name):
            return table.get(normalize_dtype(dtype))
    return None


def override_from_env() -> float | None:
    """``HF_SPEEDUP_PEAK_FLOPS`` (FLOP/s per device, e.g. ``989e12``), or None when unset.

    A value that is not a positive number raises, naming the variable: a silently ignored override
    would report the wrong MFU.
    """
    raw = os.environ.get(OVERRIDE_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"{OVERRIDE_ENV} = {raw!r} is not allowed; allowed: a positive number of FLOP/s per "
                         f"device; fix: e.g. {OVERRIDE_ENV}=989e12, or unset it to use the built-in table")
    return value


def resolve_peak_flops(device_type: str, device_name: str | None, dtype: str,
                       override: float | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s per device, where it came from: 'override' | 'table' | why it is unknown).

    The table covers accelerators only: on a CPU the peak depends on cores, clocks and vector units,
    so it is unknown unless the user gives one.
    """
    if override is None:
        override = override_from_env()
    if override is not None:
        return float(override), "override"
    if device_type not in ("cuda", "xpu", "hip", "rocm"):
        return None, f"peak FLOP/s unknown on {device_type} (set {OVERRIDE_ENV} to compute MFU)"
    value = peak_flops_for(device_name, dtype)
    if value is None:
        return None, f"no {normalize_dtype(dtype)} peak for {device_name!r} in the table (set {OVERRIDE_ENV})"
    return value, "table"
