"""FLOPs per token and MFU (the formula in the package docstring), and the dtype the peak FLOP/s is taken for."""

from __future__ import annotations

from typing import Any

from ...compat import tf32_matmul_enabled
from ...dtypes import short_name


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


def model_flops_per_second(tokens_per_second: float | None, flops_per_tok: float | None) -> float | None:
    """Achieved model FLOP/s (all ranks): FLOPs per token x tokens/s; None when either is unknown."""
    if not tokens_per_second or not flops_per_tok:
        return None
    return flops_per_tok * tokens_per_second


def fraction_of_peak(achieved: float | None, peak_per_device: float | None, num_devices: int = 1) -> float | None:
    """``achieved`` FLOP/s over ``peak_per_device`` x devices (the measured matmul peak); None when unknown."""
    if not achieved or not peak_per_device or num_devices < 1:
        return None
    return achieved / (peak_per_device * num_devices)


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
