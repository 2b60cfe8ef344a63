"""Write the tiny Llama as a real GGUF file, so GGUF loading is tested offline (no download)."""

from __future__ import annotations

import os
from pathlib import Path

# GGUF tensor names of a Llama block, as llama.cpp's converter writes them.
_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
             "model.norm.weight": "output_norm.weight"}


def save_gguf(model, path: str | os.PathLike, quant: str = "q8_0") -> Path:
    """Write a Llama-architecture model as a GGUF file (``q8_0`` matrices or ``f32``), llama.cpp layout.

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
