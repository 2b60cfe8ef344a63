"""A GGUF-loaded model made trainable: one helper shared by load_model, the LoRA feature and the trainer.

It sits among the leaves so that every layer which may meet a GGUF model (features, loading, trainer)
can clear its stale quantizer flag the same way.
"""

from __future__ import annotations

import torch

from . import compat
from .blocks import unwrap_model


def _gguf_quantizer(model):
    """The model's GGUF quantizer, or None where it has another one or none."""
    q = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(q, "quantization_config", None), "quant_method", None)
    return q if str(getattr(method, "value", method)).lower() == "gguf" else None


def clear_stale_gguf_quantizer(model) -> str | None:
    """Make a GGUF-loaded model trainable when its weights really are plain floats; returns what was done.

    transformers dequantizes GGUF tensors into ordinary ``nn.Linear`` weights, yet (5.x, legacy
    architectures such as llama) keeps a ``GgufHfQuantizer`` on the model whose ``is_trainable`` is
    False, so ``Trainer.__init__`` refuses it even with LoRA attached. The flag is stale: we drop it
    with the quantizer's own ``remove_quantization_config`` (what transformers does itself for
    ``GgufConfig(dequantize=True)``), only after checking that no packed GGUF layer and no integer
    weight is left. Raises where weights are still packed: those cannot be trained.
    """
    base = unwrap_model(model)
    q = _gguf_quantizer(base)
    if q is None:
        return None
    packed = [n for n, m in base.named_modules() if "gguf" in type(m).__name__.lower() or "ggml" in type(m).__name__.lower()]
    packed += [n for n, p in base.named_parameters() if not p.is_floating_point()]
    if packed or getattr(q, "packed_modules", None):
        raise ValueError(
            f"this GGUF model keeps {len(packed) or len(q.packed_modules)} weight(s) packed in GGUF blocks "
            f"(e.g. {(packed or list(q.packed_modules))[:3]}), which cannot be trained; fix: load it dequantized with "
            "hf_speedup.load_model(path_to.gguf) or from_pretrained(..., gguf_file=..., "
            "quantization_config=GgufConfig(dequantize=True))"
        )
    compat.remove_quantization_config(q, base)
    for m in base.modules():  # transformers marks every sub-model's config as quantized too
        cfg = getattr(m, "config", None)
        if getattr(cfg, "_is_quantized", False):
            cfg._is_quantized = False
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in base.parameters() if isinstance(p, torch.Tensor)})
    return f"GGUF weights were dequantized to {'/'.join(dtypes)} at load; the stale GGUF quantizer flag was cleared"
