"""Padding-free batches: the collator's sequences laid end to end in one row, no padding token computed.

The row carries ``position_ids`` restarting at 0 for every sequence and no ``attention_mask``; transformers
keeps the sequences apart from those positions (a block-diagonal mask for sdpa/eager, ``cu_seqlens`` for
the flash kernels, hf_speedup's ``sdpa_varlen`` on CPU). The labels of each sequence's first token become
-100, so no token is trained to predict the next sequence: per sequence the logits and the loss are the
padded batch's (tests check it).

:func:`flattening_collator` turns the collator a user gave (or the one the Trainer would build) into
:class:`PaddingFreeCollator` where it knows how that collator makes labels; anything else is reported and
keeps padding. :func:`guard_use_cache` closes the one trap: a model called with its config's default
``use_cache=True`` creates a cache, transformers then skips packed-sequence detection and every sequence
attends to the ones before it in the row (no error, no warning). The guard turns the cache off for such
calls on the model itself, so every path (training, evaluation, a subclass's own loop) is safe.
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import DataCollatorWithFlattening

from ... import compat

IGNORE_INDEX = -100
GUARD_ATTR = "_hf_speedup_packed_rows_guard"


class PaddingFreeCollator(DataCollatorWithFlattening):
    """transformers' flattening collator with the labels the replaced collator would have made.

    ``labels``: ``"input_ids"`` (causal-LM collators: the ids are the labels, padding ids ignored as that
    collator does) or ``"features"`` (the examples' own ``labels``, none when they have none). Examples that
    arrive padded (an ``attention_mask`` with zeros) are stripped to their real tokens first.

    With ``"input_ids"``, an example that already carries ``labels`` keeps them: a trainer that prepared them
    (TRL's ``completion_only_loss`` / ``assistant_only_loss`` set the prompt to -100) meant exactly those, and
    the causal-LM collator would either fail on them (ragged lengths) or overwrite them with the ids, training
    on the prompt. One without labels but with a ``completion_mask`` or ``assistant_masks`` column gets the ids
    with the masked-out tokens at -100, as TRL builds its labels from those columns (completion-only is
    TRL's default for prompt-completion data).
    """

    def __init__(self, labels: str = "features", pad_token_id: int | None = None, source: str = "",
                 return_flash_attn_kwargs: bool = False):
        super().__init__(return_position_ids=True, separator_id=IGNORE_INDEX,
                         return_flash_attn_kwargs=return_flash_attn_kwargs)
        if labels not in ("input_ids", "features"):
            raise ValueError(f"labels = {labels!r}; allowed: 'input_ids', 'features'")
        self.labels = labels
        self.pad_token_id = pad_token_id
        self.source = source

    def __call__(self, features, return_tensors=None, separator_id=None):
        rows = [_real_tokens(f) for f in features]
        has_labels = all("labels" in r for r in rows)
        if not has_labels and any("labels" in r for r in rows) and self.labels == "features":
            raise ValueError("padding-free batch: some examples carry 'labels' and others do not; fix: give every "
                             "example its labels (or none, for a collator that makes them from input_ids)")
        if self.labels == "input_ids":
            rows = [{"input_ids": r["input_ids"], "labels": _causal_lm_labels(r, self.pad_token_id)} for r in rows]
        else:
            rows = [{k: r[k] for k in ("input_ids", "labels") if k in r} for r in rows]
        batch = super().__call__(rows, return_tensors, separator_id)
        if self.labels == "features" and not has_labels:
            batch.pop("labels", None)  # the replaced collator would not have made labels either
        return batch


MASK_COLUMNS = ("completion_mask", "assistant_masks")  # TRL's loss masks: 0 = not trained on


def _causal_lm_labels(row: dict, pad: int | None) -> list:
    """A causal-LM example's labels: its own where it carries them (prepared by the trainer, e.g. completion-
    only), else its ids with padding ids and the tokens its loss-mask columns exclude at -100."""
    if "labels" in row:
        return row["labels"]
    masks = [row[c] for c in MASK_COLUMNS if c in row]
    if any(len(m) != len(row["input_ids"]) for m in masks):
        raise ValueError(f"padding-free batch: an example's {'/'.join(c for c in MASK_COLUMNS if c in row)} is not "
                         "as long as its input_ids; fix: one mask bit per token")
    return [IGNORE_INDEX if (pad is not None and t == pad) or not all(bits) else t
            for t, *bits in zip(row["input_ids"], *masks)]


def _as_list(x) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)


def _real_tokens(feature: dict) -> dict:
    """The example without its padding (right or left), as plain lists."""
    out = {k: _as_list(feature[k]) for k in ("input_ids", "labels", *MASK_COLUMNS) if k in feature}
    if "labels" not in out and "label_ids" in feature:  # the name the replaced collators also accept
        out["labels"] = _as_list(feature["label_ids"])
    mask = feature.get("attention_mask")
    if mask is not None:
        keep = [i for i, m in enumerate(_as_list(mask)) if m]
        if len(keep) != len(out["input_ids"]):
            out = {k: [v[i] for i in keep] for k, v in out.items()}
    return out


# --------------------------------------------------------------------------------------------- conversion
def _known_kind(collator) -> tuple[str | None, Any, str]:
    """(label rule, pad id, why not) for a collator we know how to flatten."""
    from transformers import (DataCollatorForLanguageModeling, DataCollatorForSeq2Seq, DataCollatorWithPadding,
                              DefaultDataCollator, default_data_collator)

    name = type(collator).__name__
    known = (DataCollatorForLanguageModeling, DataCollatorForSeq2Seq, DataCollatorWithPadding, DefaultDataCollator)
    base = next((k for k in known if isinstance(collator, k)), None)
    if base is not None and type(collator) is not base:  # its own code may make labels differently (prompt masks)
        return None, None, (f"{name} subclasses {base.__name__}: it may make its labels its own way (a completion-only "
                            "mask, say), which a flattened row would lose; hf_speedup flattens only the classes "
                            "themselves; fix: pass DataCollatorWithFlattening-style rows yourself, or set "
                            "data.padding_free: false to silence this")
    if isinstance(collator, DataCollatorForLanguageModeling):
        if getattr(collator, "mlm", False):
            return None, None, f"{name}(mlm=True) masks tokens for masked-LM training, not a causal LM"
        return "input_ids", getattr(getattr(collator, "tokenizer", None), "pad_token_id", None), ""
    if isinstance(collator, DataCollatorForSeq2Seq):
        if getattr(collator, "model", None) is not None:
            return None, None, f"{name} with a model prepares decoder inputs of an encoder-decoder"
        return "features", None, ""
    if isinstance(collator, (DataCollatorWithPadding, DefaultDataCollator)) or collator is default_data_collator:
        return "features", None, ""
    return None, None, (f"{name} is not a collator hf_speedup knows how to flatten (it must know how the labels "
                        "are made); known: DataCollatorForLanguageModeling(mlm=False), DataCollatorWithPadding, "
                        "DataCollatorForSeq2Seq, DefaultDataCollator, default_data_collator, TRL's "
                        "DataCollatorForLanguageModeling")


def flattening_collator(collator, processing_class, trainer_builds_collator: bool = False):
    """(padding-free collator or None, note): what replaces ``collator``; None plus why where nothing can."""
    if collator is None:
        if trainer_builds_collator:
            return None, "the trainer class builds its own collator when given none; it is left to do so"
        from transformers import PreTrainedTokenizerBase
        from transformers.feature_extraction_sequence_utils import SequenceFeatureExtractor

        pads = isinstance(processing_class, (PreTrainedTokenizerBase, SequenceFeatureExtractor))
        source = ("DataCollatorWithPadding (the Trainer's default for this tokenizer)" if pads
                  else "default_data_collator (the Trainer's default)")
        return PaddingFreeCollator("features", source=source), f"PaddingFreeCollator in place of {source}"
    if isinstance(collator, DataCollatorWithFlattening):
        if not collator.return_position_ids:
            return None, f"{type(collator).__name__}(return_position_ids=False): sequences could not be told apart"
        return collator, f"{type(collator).__name__} already flattens"
    if type(collator).__module__.startswith("trl.") and hasattr(collator, "padding_free"):
        new = copy.copy(collator)
        new.padding_free = True
        return new, f"TRL's {type(collator).__name__}(padding_free=True)"
    labels, pad, why = _known_kind(collator)
    if labels is None:
        return None, why
    source = getattr(collator, "__name__", None) or type(collator).__name__
    return PaddingFreeCollator(labels, pad_token_id=pad, source=source), f"PaddingFreeCollator in place of {source}"


def is_flattening(collator) -> bool:
    """Whether ``collator`` makes padding-free rows (read off the live object)."""
    if isinstance(collator, DataCollatorWithFlattening):
        return bool(collator.return_position_ids)
    return type(collator).__module__.startswith("trl.") and bool(getattr(collator, "padding_free", False))


def probe(collator) -> tuple[bool, str]:
    """Collate two tiny examples: one row, positions restarting per sequence, no attention mask."""
    try:
        batch = collator([{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}])
    except Exception as exc:  # a collator that needs more than input_ids: report, don't fail
        return False, f"probe batch failed: {type(exc).__name__}: {exc}"
    ids, pos = batch.get("input_ids"), batch.get("position_ids")
    if ids is None or pos is None or "attention_mask" in batch:
        return False, f"probe batch has keys {sorted(batch)}: not a padding-free row"
    rows, got = tuple(ids.shape), pos.reshape(-1).tolist()
    ok = rows == (1, 5) and got == [0, 1, 2, 0, 1]
    return ok, f"probe batch of lengths 3+2 -> input_ids {rows}, position_ids {got}"


# --------------------------------------------------------------------------------------------- use_cache
def _decoder(model):
    from ...blocks import unwrap_model

    base = unwrap_model(model)
    getter = getattr(base, "get_decoder", None)
    try:
        decoder = getter() if callable(getter) else None
    except Exception:  # some models have no separate decoder
        decoder = None
    return decoder if decoder is not None else base


def _no_cache_for_packed_rows(module, args, kwargs):
    """Forward pre-hook: a call that transformers would treat as packed rows never builds a cache."""
    if (kwargs.get("use_cache") is not False and kwargs.get("position_ids") is not None
            and kwargs.get("attention_mask") is None and compat.kv_cache_arg(kwargs) is None and len(args) <= 1):
        kwargs["use_cache"] = False
        return args, kwargs
    return None


def guard_use_cache(model) -> str:
    """Install the hook on the model's decoder (idempotent); returns where it sits."""
    decoder = _decoder(model)
    if getattr(decoder, GUARD_ATTR, None) is None:
        handle = decoder.register_forward_pre_hook(_no_cache_for_packed_rows, with_kwargs=True)
        setattr(decoder, GUARD_ATTR, handle)
    return type(decoder).__name__


def use_cache_guarded(model) -> bool:
    decoder = _decoder(model)
    handle = getattr(decoder, GUARD_ATTR, None)
    return handle is not None and handle.id in decoder._forward_pre_hooks
