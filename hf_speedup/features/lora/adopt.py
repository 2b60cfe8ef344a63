"""LoRA given to the trainer rather than planned: a trainer's own ``peft_config`` (TRL) applied before planning, so
the plan, compile and the report see the adapters; a model an earlier trainer adapted trained through that
trainer's PeftModel (kept on the model it wraps: ``remember_wrapper``); the frozen ``ref`` adapter a TRL
preference trainer copies from fresh adapters removed. The feature's ``prepare`` and ``attach`` hooks."""

from __future__ import annotations

import copy
import logging
import os

import torch

logger = logging.getLogger("hf_speedup")

WRAPPER_ATTR = "_hf_speedup_peft_model"


def remember_wrapper(peft_model) -> None:
    """peft adds the adapters to the model it wraps, in place: the PeftModel is kept on that model, so a later
    trainer handed the same object trains through it (the stock Trainer trains the object it is given) instead of
    taking the bare model with adapter layers for a PeftModel."""
    base = getattr(getattr(peft_model, "base_model", None), "model", None)
    if base is not None:
        object.__setattr__(base, WRAPPER_ATTR, peft_model)  # not a submodule: state_dict and modules() unchanged


def wrapper_of(model):
    """The PeftModel hf_speedup made around ``model`` for an earlier trainer, else ``model``."""
    return vars(model).get(WRAPPER_ATTR, model) if isinstance(model, torch.nn.Module) else model


def prepare(inputs: dict, args, outcome) -> dict:
    """Before planning: the PeftModel an earlier trainer made around the model, then the trainer's ``peft_config``
    applied (it wins over the preset's lora section). Returns TrainingArguments overrides."""
    model = inputs.get("model")
    reused = wrapper_of(model)
    if reused is not model:
        inputs["model"] = reused
    outcome.handoff["fresh_adapters"] = not hasattr(inputs.get("model"), "peft_config")  # adapters made here
    note, overrides = adopt_peft_config(inputs, args)
    if note:
        outcome.notes.append(note)
    if reused is not model:
        outcome.notes.append(
            "the model was adapted in place by an earlier trainer (peft adds its layers to the model it wraps): "
            "trained through that trainer's PeftModel, adapters as they are")
    return overrides


def attach(decision, trainer, outcome, setup) -> None:
    """After the trainer's ``__init__``: a ``ref`` adapter it copied from adapters hf_speedup made is removed."""
    if outcome.handoff.get("fresh_adapters") and (note := drop_reference_adapter(trainer.model)):
        outcome.notes.append(note)


def adopt_peft_config(inputs: dict, args) -> tuple[str | None, dict]:
    """Wrap the model with the trainer's ``peft_config`` now (seeded as TRL does), so the plan, compile and the
    report see the adapters; the trainer then gets the PeftModel. The user's LoRA wins over a preset's.

    Returns (a note for the report, argument overrides for the trainer). A chat template that TRL would clone
    (``chat_template_path``) is cloned here first, with TRL's handling of the tokens it adds, because TRL clones
    before it applies ``peft_config``: the overrides then tell the trainer not to clone it a second time."""
    peft_config = inputs.get("peft_config")
    model = inputs.get("model")
    if peft_config is None or model is None or hasattr(model, "peft_config"):
        return None, {}  # nothing to adopt, or a PeftModel already: the trainer's own check speaks
    from peft import get_peft_model
    from transformers import set_seed

    set_seed(getattr(args, "seed", 42))
    overrides: dict = {}
    if _clones_chat_template(args):
        added_tokens = _clone_chat_template(inputs, args)
        peft_config = _with_added_tokens(peft_config, added_tokens)
        overrides["chat_template_path"] = None
    inputs["model"] = get_peft_model(inputs["model"], peft_config)
    inputs["peft_config"] = None
    targets = getattr(peft_config, "target_modules", None)
    targets = sorted(targets) if isinstance(targets, (set, list, tuple)) else targets
    what = f"{type(peft_config).__name__}(r={getattr(peft_config, 'r', '?')}, target_modules={targets})"
    note = f"the trainer's peft_config {what} applied: it wins over the preset's lora section"
    if overrides:
        note += (f"; the chat template of {args.chat_template_path} cloned first (as TRL does), its new tokens "
                 "trainable (trainable_token_indices, modules_to_save=['lm_head'])")
    return note, overrides


def _clones_chat_template(args) -> bool:
    """TRL (SFT, reward) clones the template of a tokenizer named by ``chat_template_path``, adding its tokens;
    a ``.jinja``/``.j2`` file only sets the template."""
    path = getattr(args, "chat_template_path", None)
    return path is not None and not (os.path.isfile(path) and str(path).endswith((".jinja", ".j2")))


def _clone_chat_template(inputs: dict, args) -> list[int]:
    """TRL's ``clone_chat_template`` on the bound model and processing class (loaded from the model as TRL loads
    it when none was given); returns the ids of the tokens it added."""
    from trl.chat_template_utils import clone_chat_template

    model, processing_class = inputs["model"], inputs.get("processing_class")
    if processing_class is None:
        from transformers import AutoProcessor

        revision = (getattr(args, "model_init_kwargs", None) or {}).get("revision")
        processing_class = AutoProcessor.from_pretrained(getattr(model.config, "_name_or_path", ""), revision=revision,
                                                         trust_remote_code=getattr(args, "trust_remote_code", False))
    model, processing_class, added_tokens = clone_chat_template(model, processing_class, args.chat_template_path)
    inputs.update(model=model, processing_class=processing_class)
    return list(added_tokens)


def _with_added_tokens(peft_config, added_tokens: list[int]):
    """A copy of ``peft_config`` that trains the added tokens' embeddings and the ``lm_head``, as TRL makes it
    (TRL edits the caller's config in place; this leaves it as given)."""
    if not added_tokens:
        return peft_config
    peft_config = copy.deepcopy(peft_config)
    indices = peft_config.trainable_token_indices
    if indices is None:
        peft_config.trainable_token_indices = {"embed_tokens": list(added_tokens)}
    elif isinstance(indices, dict):
        indices.setdefault("embed_tokens", []).extend(added_tokens)
    else:  # a list of ids for the input embedding
        peft_config.trainable_token_indices = [*indices, *added_tokens]
    if "lm_head" not in (peft_config.modules_to_save or []):
        logger.warning("hf_speedup: cloning the chat template added tokens but 'lm_head' is not in the peft_config's "
                       "modules_to_save; added it (as TRL does), so the model can learn to generate them")
        peft_config.modules_to_save = [*(peft_config.modules_to_save or []), "lm_head"]
    return peft_config


def drop_reference_adapter(model) -> str | None:
    """Delete the frozen ``ref`` adapter a TRL trainer (DPO, KTO, GRPO, RLOO) added to the PeftModel hf_speedup
    made (none of its own is called ``ref``): it copies a pretrained adapter for the reference model, but ours are fresh (a no-op, like the base
    model), and stock TRL given ``peft_config`` adds none and scores the reference with the adapters disabled,
    which it does again once ``ref`` is gone (it checks ``"ref" in model.peft_config`` on every step)."""
    model = getattr(model, "_orig_mod", model)
    if "ref" not in (getattr(model, "peft_config", None) or ()) or not hasattr(model, "delete_adapter"):
        return None
    model.delete_adapter("ref")
    return ("removed the frozen 'ref' adapter the trainer copied from hf_speedup's fresh one: the reference "
            "model is the base model with adapters disabled, as with the trainer's own peft_config")
