"""The model's task head under LoRA: peft's task type, a new head trained in full and saved with the adapter
(``modules_to_save``), and the check that the first optimizer steps changed it."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ...blocks import unwrap_model
from ...model_parts import NEW_HEADS, head_kind, head_modules
from ...plan_types import Decision, Outcome
from ..probe import steps_trained
from .targets import _peft_prefix, adapted_path

# peft's task type for each head (model_parts.head_kind); any other head gets peft's generic PeftModel
TASK_TYPES = {"causal_lm": "CAUSAL_LM", "seq2seq_lm": "SEQ_2_SEQ_LM", "sequence_classification": "SEQ_CLS",
              "token_classification": "TOKEN_CLS", "question_answering": "QUESTION_ANS"}


def _head(info) -> tuple[str | None, tuple[str, ...], str]:
    """(peft task type, modules to train in full and save with the adapter, reason text) from the model's head."""
    if info is None:
        return None, (), ""
    task = TASK_TYPES.get(info.head)
    if info.head in NEW_HEADS:
        heads = tuple(info.head_modules)
        return task, heads, (f"; peft task type {task}: the {info.head.replace('_', ' ')} head "
                             f"({', '.join(heads) or 'none found'}) is new on a pretrained backbone, so it trains "
                             "in full and is saved with the adapter (modules_to_save)")
    if task is None:
        head = (" has a masked-LM head, pretrained with the backbone: kept frozen;" if info.head == "masked_lm"
                else " is not a transformers causal LM:")
        return None, (), f"; {info.architecture}{head} adapters added through peft's generic PeftModel (the model's " \
                         "own forward and loss)"
    return task, (), ""


def _live_head(model, st) -> tuple[str | None, tuple[str, ...]]:
    """(peft task type, head modules to train in full): the plan's, or the live model's head where the plan was
    made without the model (``load_model``)."""
    if st.task_type is not None:
        return st.task_type, st.modules_to_save
    kind = head_kind(unwrap_model(model))
    return TASK_TYPES.get(kind), head_modules(unwrap_model(model)) if kind in NEW_HEADS else ()


def _saveable_heads(model, heads: tuple[str, ...], outcome: Outcome) -> tuple[str, ...]:
    """The head modules peft can save: peft matches ``modules_to_save`` by name suffix anywhere in the model, so a
    name that also ends another module's name (``head`` and ``lm_head``) would copy that one too: left out, said."""
    keys = [n for n, _ in model.named_modules() if n]
    kept = []
    for head in heads:
        others = [k for k in keys if k.endswith(head) and k != head and not k.startswith(head + ".")]
        if others:
            outcome.notes.append(f"head module {head!r} not trained: peft's modules_to_save would also match "
                                 f"{others[:2]}; pass your own peft_config to train it")
        else:
            kept.append(head)
    if kept:
        outcome.facts["modules_to_save"] = kept
    return tuple(kept)


# The trainable copy of each new head as it was before the first step (verify compares it after training).
_HEAD_BEFORE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def trained_heads(model) -> dict[str, nn.Module]:
    """Top-level head name -> the trainable copy peft's ``modules_to_save`` made of it."""
    from peft.utils import ModulesToSaveWrapper

    prefix = _peft_prefix(model)
    return {adapted_path(n, m, prefix): m.modules_to_save[m.active_adapters[0]]
            for n, m in model.named_modules() if isinstance(m, ModulesToSaveWrapper) and m.active_adapters}


def _head_problems(model, decision: Decision, trainer, outcome: Outcome) -> tuple[str, list[str]]:
    """(what the head check found, problems): every head planned to train has a trainable copy, and once optimizer
    steps ran, they changed it."""
    want = outcome.facts.get("modules_to_save", list(decision.settings.modules_to_save))
    if not want:
        return "", []
    heads = trained_heads(model)
    problems = [f"head {h!r} has no trainable copy (modules_to_save)" for h in want if h not in heads]
    frozen = [h for h, m in heads.items() if not all(p.requires_grad for p in m.parameters())]
    problems += [f"head {h!r} is frozen" for h in frozen]
    steps = steps_trained(trainer, outcome)
    changed = []
    for name, module in heads.items():
        before = _HEAD_BEFORE.get(module)
        now = [p.detach().clone() for p in module.parameters()]
        if steps == 0 or before is None:
            _HEAD_BEFORE[module] = now
        elif all(torch.equal(a, b) for a, b in zip(before, now)):
            problems.append(f"head {name!r} did not change in {steps} optimizer step(s)")
        else:
            changed.append(name)
    n = sum(p.numel() for m in heads.values() for p in m.parameters())
    text = f"head {', '.join(heads)} trained in full ({n:,} parameters, saved with the adapter)"
    if changed:
        text += f", changed by the first {steps} optimizer step(s)"
    return text, problems
