"""Peak dense FLOP/s by device name and dtype, the denominator of MFU.

Vendor datasheet numbers for *dense* math (no 2:4 sparsity). Unknown devices give ``None``
so MFU is reported as null rather than guessed.
"""

from __future__ import annotations

# (substring of torch.cuda.get_device_name(), lower-case) -> {dtype: FLOP/s}
# Order matters: the first matching key wins, so specific names come before generic ones.
PEAK_FLOPS: list[tuple[str, dict[str, float]]] = [
    ("h200", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),
    ("gh200", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),
    ("h100 nvl", {"bf16": 835e12, "fp16": 835e12, "tf32": 417.5e12, "fp32": 60e12}),
    ("h100 pcie", {"bf16": 756e12, "fp16": 756e12, "tf32": 378e12, "fp32": 51e12}),
    ("h100", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),  # SXM
    ("h800", {"bf16": 989e12, "fp16": 989e12, "tf32": 494.5e12, "fp32": 67e12}),
    ("b200", {"bf16": 2250e12, "fp16": 2250e12, "tf32": 1100e12, "fp32": 80e12}),
    ("a100", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("a800", {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    ("l40s", {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12}),
    ("l4", {"bf16": 121e12, "fp16": 121e12, "tf32": 60e12, "fp32": 30.3e12}),
    ("a10g", {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 31.2e12}),
    ("a10", {"bf16": 125e12, "fp16": 125e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("rtx 4090", {"bf16": 165.2e12, "fp16": 165.2e12, "tf32": 82.6e12, "fp32": 82.6e12}),
    ("rtx 3090", {"bf16": 71e12, "fp16": 71e12, "tf32": 35.6e12, "fp32": 35.6e12}),
    ("v100", {"fp16": 125e12, "fp32": 15.7e12}),
    ("t4", {"fp16": 65e12, "fp32": 8.1e12}),
    ("mi300x", {"bf16": 1307e12, "fp16": 1307e12, "fp32": 163.4e12}),
    ("mi250x", {"bf16": 383e12, "fp16": 383e12, "fp32": 47.9e12}),
]


def peak_flops_for(device_name: str | None, dtype: str, override: float | None = None) -> float | None:
    """Peak dense FLOP/s for ``dtype`` on ``device_name``; ``override`` (user-given) wins."""
    if override is not None:
        return float(override)
    if not device_name:
        return None
    name = device_name.lower()
    for key, table in PEAK_FLOPS:
        if key in name:
            return table.get(dtype)
    return None
