"""The weights' layout in a checkpoint against the live model's.

transformers 5 converts some models' weights when it loads them (a mixture of experts' per-expert ``w1/w2/w3`` into
one fused ``experts.gate_up_proj``) and converts them back when it saves (``save_original_format=True``, the
default). The Trainer's resume loads a checkpoint with a plain ``load_state_dict``, which converts nothing: the
weights stored under their original names are left at the model's initial values, with a warning only. The
checkpoint stays as the Trainer writes it (loadable wherever the original layout is expected); at resume the weights
the Trainer's load left out are loaded through ``from_pretrained``, which converts them
(:func:`load_original_layout`).
"""

from __future__ import annotations

import json
import logging
import os

logger = logging.getLogger("hf_speedup")
WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


def saved_names(folder: str) -> set[str] | None:
    """The tensor names of a checkpoint's full-model safetensors (None: no such file, e.g. adapters only)."""
    index = os.path.join(folder, INDEX)
    if os.path.isfile(index):
        with open(index) as fh:
            return set(json.load(fh).get("weight_map", {}))
    single = os.path.join(folder, WEIGHTS)
    if not os.path.isfile(single):
        return None
    from safetensors import safe_open

    with safe_open(single, "pt") as fh:
        return set(fh.keys())


def load_original_layout(model, folder: str) -> str | None:
    """Where ``folder`` holds parameters of ``model`` under other names than the model's own, load the model's
    weights from it through ``from_pretrained`` (which converts them); what was done, or None."""
    from torch.distributed.tensor import DTensor
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) or getattr(model, "_hf_peft_config_loaded", False):
        return None
    params = dict(model.named_parameters())  # tied weights once, under the name the save keeps
    if any(isinstance(p, DTensor) for p in params.values()):
        return None  # sharded: the fsdp feature loads its own checkpoints
    names = saved_names(folder)
    if names is None:
        return None
    absent = sorted(set(params) - names)
    if not absent:
        return None
    dtype = next(iter(params.values())).dtype
    converted, info = type(model).from_pretrained(folder, config=model.config, dtype=dtype, output_loading_info=True)
    unfound = set(info.get("missing_keys", ()))  # not in the checkpoint under any name (ignored on save, ...)
    found = {k: v for k, v in converted.state_dict().items() if k in set(absent) - unfound}
    if not found:
        return None
    model.load_state_dict(found, strict=False)
    what = (f"{folder} stores {len(found)} of the model's {len(params)} weights under their original names "
            f"(e.g. {sorted(found)[0]}), which the Trainer's resume does not convert: loaded through from_pretrained, "
            "which does")
    logger.warning("hf_speedup crash_safe: %s", what)
    return what
