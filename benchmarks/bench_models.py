"""The model a benchmark trains: a local folder (``--model /tmp/smollm2``), or a Llama shape built from a config
where no weights can be fetched (the GPU machine): ``llama-300m`` (hidden 1024, 16 blocks, vocabulary 32,000)."""

from __future__ import annotations

import argparse

SHAPES = {
    "llama-300m": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16,
                       num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096),
}


def load_model(model: str, dtype):
    """The model for ``--model`` in ``dtype``, its KV cache off (training)."""
    if model in SHAPES:
        from hf_speedup.tiny import tiny_llama

        built = tiny_llama(seed=0, **SHAPES[model]).to(dtype)
    else:
        from transformers import AutoModelForCausalLM

        built = AutoModelForCausalLM.from_pretrained(model, dtype=dtype)
    built.config.use_cache = False
    return built


def parser(doc: str) -> argparse.ArgumentParser:
    """A benchmark's command line with ``--model`` and ``--cuda``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a model folder, or " + ", ".join(SHAPES))
    p.add_argument("--cuda", action="store_true", help="train on the GPU (default: CPU)")
    return p
