"""load_model: load a causal LM the way the plan wants it, because some choices only exist at load time.

- QLoRA: the base is quantized while it loads (bitsandbytes NF4, double quantization, compute dtype
  = the precision decision's; quant storage = that dtype when FSDP shards the model, since FSDP needs
  one dtype per flat parameter, else bitsandbytes' uint8). With several processes (DDP or FSDP) each rank
  loads onto its own GPU (``device_map={"": LOCAL_RANK}``). A model handed to the trainer is never re-quantized.
- dtype: a frozen base (LoRA/QLoRA) loads in the compute dtype (bf16/fp16 where the precision
  decision picked it) to halve its memory; a fully fine-tuned model loads in fp32, the master
  weights mixed precision expects.
- GGUF: a ``.gguf`` file (or ``gguf_file=``) loads dequantized to float weights
  (``GgufConfig(dequantize=True)``), so the Trainer accepts it and LoRA can wrap it.

Whatever the caller passes to ``from_pretrained`` wins over these choices (and is logged).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from . import compat
from .config import SpeedupConfigError
from .gguf import clear_stale_gguf_quantizer
from .plan import plan_for

logger = logging.getLogger("hf_speedup")


def split_gguf(name_or_path: str | os.PathLike, kwargs: dict) -> tuple[str, str | None]:
    """``dir/model.gguf`` -> (``dir``, ``model.gguf``); a ``gguf_file=`` kwarg is kept as given."""
    path = str(name_or_path)
    if kwargs.get("gguf_file"):
        return path, kwargs["gguf_file"]
    if path.endswith(".gguf") and os.path.isfile(path):
        p = Path(path)
        return str(p.parent), p.name
    return path, None


def load_kwargs(name_or_path: str | os.PathLike, plan, **user_kwargs: Any) -> tuple[str, dict]:
    """(path, ``from_pretrained`` kwargs) for ``plan`` — pure, so the choices are testable without loading."""
    path, gguf_file = split_gguf(name_or_path, user_kwargs)
    ours: dict[str, Any] = {"dtype": _load_dtype(plan)}
    bits = plan["lora"].settings.quantization if plan["lora"].active else None
    if gguf_file:
        ours["gguf_file"] = gguf_file
        if bits:
            _gguf_cannot_quantize(plan, bits)
        if (cfg := compat.gguf_dequantize_config()) is not None:
            ours["quantization_config"] = cfg
    elif bits:
        ours["quantization_config"] = bnb_config(plan, bits)
        if plan.caps.world_size > 1:
            # bitsandbytes' default is cuda:0 on every rank, and FSDP is no exception: transformers loads a
            # quantized model whole on every rank (no rank-0-only loading), so each rank quantizes onto its own GPU
            ours["device_map"] = {"": plan.caps.local_rank}
    overridden = sorted(k for k in ours if k in user_kwargs and k != "gguf_file")
    if overridden:
        logger.info("hf_speedup.load_model: keeping the caller's %s over the plan's choice", overridden)
    ours.update(user_kwargs)
    return path, ours


def _load_dtype(plan) -> torch.dtype:
    """Frozen bases in the compute dtype; trained weights in fp32 (mixed precision keeps fp32 masters)."""
    if plan["lora"].active:
        return plan["precision"].settings.dtype
    return torch.float32


def bnb_config(plan, bits: str):
    """The bitsandbytes config of a QLoRA (NF4) or 8-bit base."""
    from transformers import BitsAndBytesConfig

    if bits == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    dtype = plan["precision"].settings.dtype
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=_quant_storage(plan, dtype),
    )


def _quant_storage(plan, dtype: torch.dtype) -> torch.dtype:
    """FSDP shards 4-bit weights only when stored in the other parameters' dtype (the FSDP decision may
    name it); unsharded, bitsandbytes' uint8 keeps two weights per byte and parameter counts readable."""
    if not plan["fsdp"].active:
        return torch.uint8
    return plan["fsdp"].settings.qlora_quant_storage or dtype


def _gguf_cannot_quantize(plan, bits: str) -> None:
    """A GGUF file cannot also be loaded through bitsandbytes (transformers refuses the pair)."""
    msg = (f"lora.quantization = {bits!r} cannot apply to a GGUF file: transformers cannot load a GGUF through "
           "bitsandbytes; allowed for GGUF: null (LoRA on the dequantized weights); fix: load the original "
           "safetensors checkpoint, or set lora.quantization: null")
    if plan.config.lora.strict:
        raise SpeedupConfigError([msg])
    logger.warning("hf_speedup.load_model: %s; loading it dequantized instead", msg)


def load_model(name_or_path: str | os.PathLike, speedup: Any = "auto", *, caps=None, model_class=None,
               **from_pretrained_kwargs: Any):
    """Load a causal LM (hub id, local directory or ``.gguf`` file) the way ``speedup`` wants it.

    ``caps`` overrides the hardware probe (tests); ``model_class`` defaults to AutoModelForCausalLM.
    Pass the result to ``SpeedupTrainer(model=..., speedup=<same speedup>)``.
    """
    return load_planned(name_or_path, plan_for(speedup, caps=caps), model_class=model_class, **from_pretrained_kwargs)


def load_planned(name_or_path: str | os.PathLike, plan, *, model_class=None, **from_pretrained_kwargs: Any):
    """:func:`load_model` for a plan already made without the model (the trainer's, for its own device)."""
    path, kwargs = load_kwargs(name_or_path, plan, **from_pretrained_kwargs)
    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class
    logger.info("hf_speedup.load_model: %s with %s", path, _describe(kwargs))
    model = model_class.from_pretrained(path, **kwargs)
    note = clear_stale_gguf_quantizer(model)  # older transformers without GgufConfig(dequantize)
    if note:
        logger.info("hf_speedup.load_model: %s", note)
    return model


def load_tokenizer(name_or_path: str | os.PathLike, **kwargs: Any):
    """The tokenizer beside a model, including the one embedded in a ``.gguf`` file."""
    from transformers import AutoTokenizer

    path, gguf_file = split_gguf(name_or_path, kwargs)
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    return AutoTokenizer.from_pretrained(path, **kwargs)


def _describe(kwargs: dict) -> str:
    return ", ".join(f"{k}={getattr(v, '__name__', None) or v}" for k, v in kwargs.items())

