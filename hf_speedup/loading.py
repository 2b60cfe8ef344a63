"""load_model: load a causal LM the way the plan wants it, because some choices only exist at load time.

- QLoRA: the base is quantized while it loads (bitsandbytes NF4, double quantization, compute dtype
  = the precision decision's; quant storage = that dtype when FSDP shards the model, since FSDP needs
  one dtype per flat parameter, else bitsandbytes' uint8). A model handed to the trainer is never
  re-quantized.
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

logger = logging.getLogger("hf_speedup")


def compute_dtype(precision_decision) -> torch.dtype:
    """The dtype matmuls run in under the precision decision (bf16, fp16, else fp32)."""
    applied = str(getattr(precision_decision, "applied", "") or "").lower()
    if "bf16" in applied or "bfloat16" in applied:
        return torch.bfloat16
    if "fp16" in applied or "float16" in applied:
        return torch.float16
    return torch.float32


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
    bits = plan["lora"].settings.get("quantization") if plan["lora"].active else None
    if gguf_file:
        ours["gguf_file"] = gguf_file
        if bits:
            _gguf_cannot_quantize(plan, bits)
        if (cfg := compat.gguf_dequantize_config()) is not None:
            ours["quantization_config"] = cfg
    elif bits:
        ours["quantization_config"] = bnb_config(plan, bits)
        if plan.caps.world_size > 1 and not plan["fsdp"].active:
            ours["device_map"] = {"": plan.caps.local_rank}  # bitsandbytes' default is cuda:0 on every rank
    overridden = sorted(k for k in ours if k in user_kwargs and k != "gguf_file")
    if overridden:
        logger.info("hf_speedup.load_model: keeping the caller's %s over the plan's choice", overridden)
    ours.update(user_kwargs)
    return path, ours


def _load_dtype(plan) -> torch.dtype:
    """Frozen bases in the compute dtype; trained weights in fp32 (mixed precision keeps fp32 masters)."""
    if plan["lora"].active:
        return compute_dtype(plan["precision"])
    return torch.float32


def bnb_config(plan, bits: str):
    """The bitsandbytes config of a QLoRA (NF4) or 8-bit base."""
    from transformers import BitsAndBytesConfig

    if bits == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    dtype = compute_dtype(plan["precision"])
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
    named = (plan["fsdp"].settings.get("qlora") or {}).get("bnb_4bit_quant_storage")
    return getattr(torch, str(named).replace("torch.", "")) if named else dtype


def _gguf_cannot_quantize(plan, bits: str) -> None:
    """A GGUF file cannot also be loaded through bitsandbytes (transformers refuses the pair)."""
    msg = (f"lora.quantization = {bits!r} cannot apply to a GGUF file: transformers cannot load a GGUF through "
           "bitsandbytes; allowed for GGUF: null (LoRA on the dequantized weights); fix: load the original "
           "safetensors checkpoint, or set lora.quantization: null")
    if plan.config.lora.strict:
        raise SpeedupConfigError([msg])
    plan["lora"].fallbacks.append(f"gguf: {msg}")
    logger.warning("hf_speedup.load_model: %s; loading it dequantized instead", msg)


def load_model(name_or_path: str | os.PathLike, speedup: Any = "auto", *, caps=None, model_class=None,
               **from_pretrained_kwargs: Any):
    """Load a causal LM (hub id, local directory or ``.gguf`` file) the way ``speedup`` wants it.

    ``caps`` overrides the hardware probe (tests); ``model_class`` defaults to AutoModelForCausalLM.
    Pass the result to ``SpeedupTrainer(model=..., speedup=<same speedup>)``.
    """
    from .plan import build_plan

    plan = build_plan(speedup, caps=caps, model=None, args=None)
    path, kwargs = load_kwargs(name_or_path, plan, **from_pretrained_kwargs)
    if model_class is None:
        from transformers import AutoModelForCausalLM as model_class
    logger.info("hf_speedup.load_model: %s with %s", path, _describe(kwargs))
    model = model_class.from_pretrained(path, **kwargs)
    note = compat.clear_stale_gguf_quantizer(model)  # older transformers without GgufConfig(dequantize)
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


# GGUF tensor names of a Llama block, as llama.cpp's converter writes them.
_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
             "model.norm.weight": "output_norm.weight"}


def save_gguf(model, path: str | os.PathLike, quant: str = "q8_0") -> Path:
    """Write a Llama-architecture model as a GGUF file (``q8_0`` matrices or ``f32``), llama.cpp layout.

    For testing GGUF loading offline: the tiny Llama becomes a real quantized GGUF, no download.
    q/k rows are permuted the way llama.cpp's converter does (transformers undoes it on load).
    """
    import gguf

    cfg = model.config
    qtype = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "f32": None}[quant]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(str(getattr(cfg, "name_or_path", "") or "hf_speedup-llama"))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))))
    w.add_vocab_size(cfg.vocab_size)
    for key, tid in (("bos", cfg.bos_token_id), ("eos", cfg.eos_token_id), ("pad", cfg.pad_token_id)):
        if isinstance(tid, int):
            getattr(w, f"add_{key}_token_id")(tid)
    for name, t in model.state_dict().items():
        _add_gguf_tensor(w, name, t.detach().float().cpu().numpy(), cfg, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _add_gguf_tensor(writer, name: str, array, cfg, qtype) -> None:
    import gguf

    if name in _GGUF_TOP:
        gname = _GGUF_TOP[name]
    else:  # model.layers.{i}.{module}.weight
        parts = name.split(".")
        gname = f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:-1])]}.weight"
    if ".attn_q." in gname:
        array = _llama_cpp_permute(array, cfg.num_attention_heads)
    elif ".attn_k." in gname:
        array = _llama_cpp_permute(array, cfg.num_key_value_heads)
    if qtype is not None and array.ndim == 2:
        writer.add_tensor(gname, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    else:
        writer.add_tensor(gname, array)


def _llama_cpp_permute(w, n_head: int):
    """llama.cpp's rotary row order for q/k (interleaved halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
