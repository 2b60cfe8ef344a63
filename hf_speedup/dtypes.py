"""The one place that maps precision names to ``torch.dtype`` and back.

Plans carry ``torch.dtype`` objects; reports, tables and peak-FLOP lookups use the short names.
"""

from __future__ import annotations

import torch

SHORT_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_ALIASES = {
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "torch.float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "torch.float16": torch.float16,
}


def to_dtype(value: str | torch.dtype) -> torch.dtype:
    """``'bf16'``, ``'bfloat16'``, ``'torch.bfloat16'`` or a dtype -> ``torch.bfloat16``."""
    if isinstance(value, torch.dtype):
        return value
    try:
        return _ALIASES[str(value).strip().lower()]
    except KeyError:
        raise ValueError(f"dtype {value!r} is not allowed; allowed: {', '.join(sorted(_ALIASES))}") from None


def short_name(value: str | torch.dtype) -> str:
    """``torch.bfloat16`` (or any alias) -> ``'bf16'``; other dtypes keep torch's own name (``'int8'``)."""
    if isinstance(value, str) and str(value).strip().lower() not in _ALIASES:
        return str(value).replace("torch.", "")
    dtype = to_dtype(value)
    return SHORT_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def long_name(value: str | torch.dtype) -> str:
    """``'bf16'`` -> ``'bfloat16'`` (the spelling transformers and accelerate configs use)."""
    return str(to_dtype(value)).replace("torch.", "")
