"""LoRA / QLoRA through peft: adapters on every projection of the repeated block, base frozen.

Target modules (``lora.target_modules``):

- ``auto``: every linear layer (``nn.Linear``, or transformers' ``Conv1D`` as in GPT-2) inside the repeated
  decoder block (for Llama q, k, v, o, gate, up, down — the QLoRA paper's finding that adapting all
  projections matches full fine-tuning; peft's own default mapping only adapts q and v), matched inside the
  blocks only, so a head's layer of the same name (BERT's ``cls.predictions.transform.dense``) is left alone.
  A mixture-of-experts block keeps its experts as fused 3-D parameters (transformers 5: ``mlp.experts.gate_up_proj``,
  ``mlp.experts.down_proj``), not ``nn.Linear``: those get adapters through peft's ``target_parameters`` (one
  rank-r pair per expert, ``lora.ParamWrapper``). peft cannot apply dropout there, so ``lora.dropout`` becomes 0
  for the whole adapter (a reported fallback; an error with ``lora.strict``). The router (``mlp.gate``) is not
  adapted: it is a small experts x hidden matrix, and moving it while fine-tuning shifts the load between experts
  (transformers adds no load-balancing loss unless ``output_router_logits`` is set); the common MoE recipes keep
  it frozen. peft's mapping is used only where no block is found.
- ``all-linear``: peft's own rule (every Linear but the output head); or an explicit list, whose names may also
  name expert parameters (``experts.gate_up_proj``).

The head decides peft's task type: a causal LM gets ``CAUSAL_LM``, a sequence / token classifier ``SEQ_CLS`` /
``TOKEN_CLS``, extractive QA ``QUESTION_ANS``, an encoder-decoder ``SEQ_2_SEQ_LM``. A classification or QA head is
new (random) on top of a pretrained backbone, so it trains in full and is saved with the adapter
(``modules_to_save``, as peft does for those task types); verify checks it trains and that the first optimizer
steps changed it. Any other model (a masked LM, whose head is pretrained; a plain ``nn.Module``) gets peft's
generic PeftModel (its own forward and loss).

QLoRA (``quantization: 4bit``) needs a 4-bit NF4 base, and quantization happens **at load time**
(``hf_speedup.load_model`` or ``from_pretrained(quantization_config=BitsAndBytesConfig(...))``); a
model handed to the trainer is never re-quantized. When it cannot be had — no bitsandbytes/CUDA
here, or the model given is not quantized — the plan falls back to plain LoRA, records why in
``fallbacks`` and logs a warning; with ``lora.strict: true`` it raises instead. We chose an explicit
fallback over an error for the unquantized model so ``speedup="qlora"`` runs anywhere, the way it
does on a CPU; ``strict`` is the switch for "I need the memory saving or nothing".

A model that already is a PeftModel keeps its adapters (reported, never wrapped twice). A model loaded from a
GGUF file is trainable once its stale quantizer flag is cleared (see
:func:`hf_speedup.gguf.clear_stale_gguf_quantizer`). The report lists what got adapters by name pattern and
count, read from the live model.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn

from ...blocks import find_blocks, unwrap_model
from ...config import SpeedupConfigError
from ...gguf import clear_stale_gguf_quantizer
from ...model_info import is_linear_layer, parameter_counts, quantization_of
from ...model_parts import NEW_HEADS, head_kind, head_modules
from ...plan_types import OFF, Decision, Outcome, PlanContext
from ..probe import steps_trained

NAME = "lora"
APPLIES_TO = "model"
logger = logging.getLogger("hf_speedup")

_BITS = {"4bit": "qlora", "8bit": "lora-8bit"}
_LOADERS = "hf_speedup.load_model(name_or_path, speedup=...)"
# peft's task type for each head (model_parts.head_kind); any other head gets peft's generic PeftModel
TASK_TYPES = {"causal_lm": "CAUSAL_LM", "seq2seq_lm": "SEQ_2_SEQ_LM", "sequence_classification": "SEQ_CLS",
              "token_classification": "TOKEN_CLS", "question_answering": "QUESTION_ANS"}
ROUTER_FROZEN = ("not adapted: a small experts x hidden matrix, and moving it while fine-tuning shifts the load "
                 "between experts (no load-balancing loss unless output_router_logits is set)")


@dataclass(frozen=True)
class Settings:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = "all-linear"  # names, or peft's "all-linear"
    target_parameters: tuple[str, ...] = ()  # fused 3-D expert weights, through peft's target_parameters
    in_blocks: bool = False  # target_modules matched inside the repeated blocks only (auto)
    task_type: str | None = None  # peft's task type, from the model's head; None: peft's generic PeftModel
    modules_to_save: tuple[str, ...] = ()  # a new task head: trained in full and saved with the adapter
    quantization: str | None = None  # the base's k-bit form: 4bit (QLoRA) | 8bit | None
    existing: bool = False  # the model already is a PeftModel: its adapters are kept
    gguf: bool = False  # a GGUF base, dequantized at load


# ----------------------------------------------------------------------------------------- decide
def resolve_targets(ctx: PlanContext) -> tuple[list[str] | str, str]:
    """(target modules, where they came from) for ``lora.target_modules``."""
    asked = ctx.config.lora.target_modules
    info = ctx.model
    if asked != "auto":
        if isinstance(asked, (list, tuple)):
            experts = info.expert_parameters if info is not None else ()
            return [t for t in asked if not _names_parameter(t, experts) or t.split(".")[-1] in
                    (info.linear_names if info is not None else ())], "as configured"
        return asked, "as configured"
    if info is not None and info.linear_names:
        but = f" but its router{'s' if len(info.routers) > 1 else ''}" if info.routers else ""
        return list(info.linear_names), f"every linear layer in the repeated {info.block_class}{but}, inside the blocks only"
    if info is not None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_MAP

        if info.model_type in PEFT_MAP:
            return list(PEFT_MAP[info.model_type]), f"peft's default for model_type {info.model_type!r}"
    if info is not None and info.model_type == "unknown":  # not a transformers model: peft sees no output head
        return "all-linear", "peft's all-linear (every linear layer: this model has no transformers config naming its head)"
    return "all-linear", "peft's all-linear (every Linear but the output head)"


def _names_parameter(target: str, parameters) -> bool:
    """peft's suffix rule for ``target_parameters``: ``experts.down_proj`` names ``mlp.experts.down_proj``."""
    return any(p == target or p.endswith("." + target) for p in parameters)


def resolve_parameters(ctx: PlanContext) -> list[str]:
    """The fused expert weights that get adapters: all of them under ``auto``, those an explicit list names."""
    asked, info = ctx.config.lora.target_modules, ctx.model
    experts = info.expert_parameters if info is not None else ()
    if asked == "auto":
        return list(experts)
    if isinstance(asked, (list, tuple)):
        return [t for t in asked if _names_parameter(t, experts)]
    return []


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


def decide(ctx: PlanContext) -> Decision:
    s, info = ctx.config.lora, ctx.model
    requested = OFF if not s.enabled else _BITS.get(s.quantization, "lora")
    if info is not None and info.is_peft:
        return Decision(NAME, requested, "existing adapters", settings=Settings(existing=True),
                        reason="the model already is a PeftModel: its adapters are trained as they are, "
                               "not wrapped again")
    if not s.enabled:
        return Decision(NAME, requested, OFF, settings=Settings(), reason=_off_reason(info))
    targets, source = resolve_targets(ctx)
    parameters = resolve_parameters(ctx)
    bits, reason, fallbacks = _decide_quantization(ctx)
    gguf = info is not None and info.quantization == "gguf"
    reason = f"LoRA r={s.r}, alpha={s.alpha} on {_fmt(targets) or 'no linear layer'} ({source})" + reason
    dropout = s.dropout
    if parameters:
        reason += (f"; the experts' fused 3-D weights {', '.join(parameters)} through peft's target_parameters "
                   "(one rank-r pair per expert)")
        if dropout:
            why = (f"lora.dropout {dropout:g} -> 0: peft's lora.ParamWrapper (the adapters on the expert weights) "
                   "cannot apply dropout, and one adapter has one dropout")
            if s.strict:
                raise SpeedupConfigError([
                    f"lora.dropout = {dropout!r} cannot apply to the expert weights {list(parameters)} (peft's "
                    "lora.ParamWrapper has no dropout) and lora.strict = true; allowed here: 0.0; fix: set "
                    "lora.dropout: 0, or list lora.target_modules without the expert weights"])
            logger.warning("hf_speedup lora fallback: %s", why)
            fallbacks.append(why)
            dropout, reason = 0.0, reason + f"; {why}"
    if info is not None and info.routers:
        reason += f"; router {', '.join(info.routers)} {ROUTER_FROZEN}"
    task, heads, head_text = _head(info)
    reason += head_text
    if gguf:
        reason += "; GGUF base: dequantized at load, its stale quantizer flag is cleared so the Trainer accepts it"
    settings = Settings(r=s.r, alpha=s.alpha, dropout=dropout, quantization=bits, gguf=gguf,
                        target_modules=targets if isinstance(targets, str) else tuple(targets),
                        target_parameters=tuple(parameters), in_blocks=s.target_modules == "auto" and bool(
                            info is not None and info.linear_names), task_type=task, modules_to_save=heads)
    return Decision(NAME, requested, _BITS.get(bits, "lora"), settings=settings, reason=reason,
                    fallbacks=tuple(fallbacks))


def _off_reason(info) -> str:
    if info is not None and info.quantization in ("4bit", "8bit"):
        logger.warning("hf_speedup: the model is %s-quantized but lora is off; the Trainer only trains a "
                       "quantized base through adapters", info.quantization)
        return (f"off in the config; note: the base is {info.quantization}-quantized, which the Trainer can only "
                "train through adapters (set lora.enabled: true)")
    return "off in the config (full fine-tuning)"


def _decide_quantization(ctx: PlanContext) -> tuple[str | None, str, list[str]]:
    """(base quantization, reason suffix, fallbacks): QLoRA / 8-bit base, or the explicit fallback to
    plain LoRA (or an error when strict)."""
    s, caps, info = ctx.config.lora, ctx.caps, ctx.model
    have = info.quantization if info is not None and info.quantization in ("4bit", "8bit") else None
    if have:  # already quantized at load: adapt what is there, whatever the config says
        fallbacks = ([f"{_BITS[s.quantization]} -> {_BITS[have]}: the model was loaded in {have}"]
                     if s.quantization and s.quantization != have else [])
        return have, f"; base loaded in {have} (k-bit preparation, non-reentrant)", fallbacks
    if not s.quantization:
        return None, "", []
    problem = _quantization_problem(s.quantization, caps, info)
    if problem is None:  # no model yet: load_model will quantize it
        how = "NF4, double quantization" if s.quantization == "4bit" else "LLM.int8"
        return s.quantization, f"; base in {s.quantization} ({how}) at load time", []
    field_problem, fix = problem
    if s.strict:
        raise SpeedupConfigError([
            f"lora.quantization = {s.quantization!r} cannot be honoured: {field_problem}; allowed here: null "
            f"(plain LoRA); fix: {fix}, or set lora.strict: false to fall back to plain LoRA"
        ])
    logger.warning("hf_speedup: %s -> plain LoRA: %s (%s)", _BITS[s.quantization], field_problem, fix)
    return (None, f"; fell back from {_BITS[s.quantization]} to plain LoRA: {field_problem} ({fix})",
            [f"{_BITS[s.quantization]} -> lora: {field_problem}"])


def _quantization_problem(bits: str, caps, info) -> tuple[str, str] | None:
    """Why a k-bit base cannot be had, with the fix; None where it can (at load time)."""
    if not caps.bitsandbytes:
        return (caps.bitsandbytes_reason or "bitsandbytes is not usable here",
                "run on a CUDA machine with bitsandbytes installed (pip install bitsandbytes)")
    if info is not None:
        what = "a GGUF model (dequantized to float)" if info.quantization == "gguf" else "not quantized"
        return (f"the model passed in is {what}; a {bits} base must be quantized when it is loaded",
                f"load it with {_LOADERS} (or from_pretrained(..., quantization_config=BitsAndBytesConfig(...)))")
    return None


def _fmt(targets) -> str:
    return targets if isinstance(targets, str) else ", ".join(targets)


def training_args(decision: Decision, args) -> dict:
    return {}


# ----------------------------------------------------------------------------------------- apply
def apply(decision: Decision, setup, outcome: Outcome) -> None:
    """k-bit preparation (k-bit bases), then ``get_peft_model``; a no-op when off or already peft."""
    if not decision.active:
        return
    model = setup.model
    if model is None:  # SpeedupTrainer builds the first model of a model_init itself: only direct callers get here
        raise SpeedupConfigError(["lora: there is no model to adapt (model=None); fix: pass model=... or "
                                  "model_init=... to SpeedupTrainer"])
    note = clear_stale_gguf_quantizer(model)
    if note:
        outcome.facts["gguf"] = note
        logger.info("hf_speedup: %s", note)
    if decision.settings.existing:
        return
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    st = decision.settings
    targets = st.target_modules if isinstance(st.target_modules, str) else list(st.target_modules)
    matched = _check_targets(model, targets, st.target_parameters)
    _check_parameters(model, st.target_parameters)
    if quantization_of(model) in ("4bit", "8bit"):
        # Checkpointing is the checkpointing feature's job (applied next, per block, non-reentrant):
        # peft's own switch would enable it on every block, reentrant, a second time.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    task_type, heads = _live_head(model, st)
    if task_type is None and "generic PeftModel" not in decision.reason:
        outcome.notes.append(f"{type(model).__name__} is not a transformers causal LM: adapters added through "
                             "peft's generic PeftModel (the model's own forward and loss)")
    heads = _saveable_heads(model, heads, outcome)
    # Conv1D (GPT-2) stores its weight transposed: peft must be told, or it warns and flips it per layer
    fan_in_fan_out = bool(matched) and all(type(m).__name__ == "Conv1D" for m in matched)
    peft_targets = _in_blocks(model, targets) if st.in_blocks and not isinstance(targets, str) else targets
    config = LoraConfig(r=st.r, lora_alpha=st.alpha, lora_dropout=st.dropout, target_modules=peft_targets,
                        target_parameters=list(st.target_parameters) or None, bias="none", task_type=task_type,
                        fan_in_fan_out=fan_in_fan_out, modules_to_save=list(heads) or None)
    try:
        setup.model = get_peft_model(model, config)
        remember_wrapper(setup.model)
    except ValueError as exc:  # peft's "Target modules ... not found" and the like: name the field and the fix
        raise SpeedupConfigError([
            f"lora.target_modules = {targets!r}: peft could not adapt this {type(model).__name__} ({exc}); allowed: "
            f"the names of its linear layers {sorted(_linear_leaves(model))}; fix: set lora.target_modules: "
            "[names] from that list"]) from None
    logger.info("hf_speedup: LoRA (%s) on %s", decision.applied, _fmt(targets))


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


def _live_head(model, st: Settings) -> tuple[str | None, tuple[str, ...]]:
    """(peft task type, head modules to train in full): the plan's, or the live model's head where the plan was
    made without the model (``load_model``)."""
    if st.task_type is not None:
        return st.task_type, st.modules_to_save
    kind = head_kind(unwrap_model(model))
    return TASK_TYPES.get(kind), head_modules(unwrap_model(model)) if kind in NEW_HEADS else ()


def _in_blocks(model, leaves: list[str]) -> str | list[str]:
    """peft ``target_modules`` matching ``leaves`` inside the repeated blocks only: a regular expression over the
    blocks' containers (``model.layers.<i>. ... .q_proj``), or the layers' full names where the blocks are not
    numbered children of a container."""
    names = {id(m): n for n, m in model.named_modules()}
    paths = [names.get(id(b), "") for b in find_blocks(model)]
    containers = {p.rsplit(".", 1)[0] for p in paths if "." in p and p.rsplit(".", 1)[1].isdigit()}
    if not paths or any(not (p and p.rsplit(".", 1)[-1].isdigit()) for p in paths):
        return [f"{p}.{n}" if p else n for p in paths for n, m in model.get_submodule(p).named_modules()
                if n and is_linear_layer(m) and n.split(".")[-1] in leaves]
    alternatives = "|".join(re.escape(c) for c in sorted(containers))
    return rf"(?:{alternatives})\.\d+\.(?:.*\.)?(?:{'|'.join(re.escape(t) for t in leaves)})"


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


def _linear_leaves(model) -> set[str]:
    return {n.split(".")[-1] for n, m in model.named_modules() if n and is_linear_layer(m)}


def _parameter_paths(model) -> list[str]:
    """Full names of the model's fused 3-D (expert) parameters."""
    return [n for n, p in model.named_parameters() if p.dim() == 3]


def _check_targets(model, targets, parameters=()) -> list:
    """Every configured name must match a linear layer of this model (peft's own error names no fix).

    Returns the matched layers (all linear layers for a rule such as ``all-linear``)."""
    layers = [(n, m) for n, m in model.named_modules() if n and is_linear_layer(m)]
    if isinstance(targets, str):
        if not layers:
            raise SpeedupConfigError([
                f"lora.target_modules = {targets!r}: this {type(model).__name__} has no linear layer (nn.Linear, "
                "transformers Conv1D) for LoRA to adapt; fix: set lora.enabled: false (full fine-tuning), or pass "
                "a model with linear projections"])
        return [m for _, m in layers]
    leaves = sorted({n.split(".")[-1] for n, _ in layers})
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n, _ in layers)]  # peft's suffix rule
    if missing:
        experts = sorted({".".join(p.split(".")[-2:]) for p in _parameter_paths(model)})
        also = f" or expert weights {experts}" if experts else ""
        raise SpeedupConfigError([
            f"lora.target_modules = {list(targets) + list(parameters)!r}: {missing} match no Linear layer (nn.Linear, "
            f"transformers Conv1D){' nor expert weight' if experts else ''} of this {type(model).__name__}; allowed: "
            f"{leaves}{also}, 'auto' or 'all-linear'; fix: set lora.target_modules: auto, or names from that list"
        ])
    return [m for n, m in layers if any(n == t or n.endswith("." + t) for t in targets)]


def _check_parameters(model, parameters) -> None:
    """Every expert weight named must be a 3-D parameter of the live model (the plan read it from the same model)."""
    paths = _parameter_paths(model)
    missing = [t for t in parameters if not any(p == t or p.endswith("." + t) for p in paths)]
    if missing:
        raise SpeedupConfigError([
            f"lora.target_modules: the expert weights {missing} are not 3-D parameters of this {type(model).__name__} "
            f"(it has {sorted({'.'.join(p.split('.')[-2:]) for p in paths}) or 'none'}); fix: set lora.target_modules: "
            "auto, or names from that list"])


# ----------------------------------------------------------------------------------------- verify
def lora_layers(model) -> dict[str, nn.Module]:
    """Name -> peft LoRA layer (``lora.Linear``, its bitsandbytes variants, ``lora.ParamWrapper``)."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def adapted_path(name: str, layer: nn.Module, prefix: str = "") -> str:
    """What a LoRA layer adapts, by its name in the transformers model: ``model.layers.0.self_attn.q_proj``, or
    ``model.layers.0.mlp.experts.gate_up_proj`` for a wrapped parameter (peft nests one ``ParamWrapper`` per
    parameter of a module, each one's base layer inside the next)."""
    path = name[len(prefix):] if prefix and name.startswith(prefix) else name
    path = ".".join(part for part in path.split(".") if part != "base_layer")
    parameter = getattr(layer, "parameter_name", None)
    return f"{path}.{parameter}" if parameter else path


def pattern(path: str) -> str:
    """A name with its block indices as ``*``: ``model.layers.*.self_attn.q_proj``."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", path)


def adapter_patterns(model) -> dict[str, int]:
    """Name pattern -> number of LoRA layers on the live model (``model.layers.*.mlp.experts.gate_up_proj: 2``)."""
    prefix = _peft_prefix(model)
    return dict(Counter(pattern(adapted_path(n, m, prefix)) for n, m in lora_layers(model).items()))


def _peft_prefix(model) -> str:
    """The prefix peft puts before the transformers model's own module names (``base_model.model.``)."""
    base = unwrap_model(model)
    for name, module in model.named_modules():
        if module is base:
            return f"{name}." if name else ""
    return ""


def unwrapped_targets(model, targets) -> list[str]:
    """Linear layers inside the blocks that should carry an adapter but do not."""
    from peft.tuners.lora import LoraLayer

    out = []
    for block in find_blocks(model):
        wrapped = [n for n, m in block.named_modules() if isinstance(m, LoraLayer)]
        for n, m in block.named_modules():
            if not is_linear_layer(m) or any(n == w or n.startswith(w + ".") for w in wrapped):
                continue
            if targets == "all-linear" or any(n == t or n.endswith("." + t) for t in targets):
                out.append(n)
    return out


def unwrapped_parameters(model, parameters) -> list[str]:
    """Expert weights named in ``parameters`` that no ``lora.ParamWrapper`` adapts, by block-relative name."""
    if not parameters:
        return []
    out = []
    for block in find_blocks(model):
        wrapped = {adapted_path(n, m) for n, m in block.named_modules() if getattr(m, "parameter_name", None)}
        for n, p in block.named_parameters():
            path = ".".join(part for part in n.split(".") if part not in ("base_layer", "parametrizations", "original"))
            if p.dim() == 3 and _names_parameter_path(path, parameters) and path not in wrapped:
                out.append(path)
    return out


def _names_parameter_path(path: str, parameters) -> bool:
    return any(path == t or path.endswith("." + t) for t in parameters)


def non_adapter_trainables(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n and "modules_to_save" not in n]


def _quantized_base(base, want: str) -> bool:
    if type(base.weight).__name__ == want:
        return True
    # FSDP2 turns each Params4bit into a DTensor; bitsandbytes keeps the quant state on the module for that
    return (want == "Params4bit" and type(base).__name__ == "Linear4bit"
            and getattr(base, "quant_state", None) is not None)


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


def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    model = trainer.model
    if not decision.active:
        return False, "off"
    if not hasattr(model, "peft_config"):
        return False, f"the trained model is a {type(model).__name__}, not a PeftModel"
    layers = lora_layers(model)
    if decision.settings.existing:
        adapters = {k: sorted(getattr(v, "target_modules", None) or []) for k, v in model.peft_config.items()}
        return bool(layers), f"existing adapters kept: {adapters}; {len(layers)} LoRA layers"
    problems = _problems(model, decision, layers)
    patterns = adapter_patterns(model)
    outcome.facts["adapters"] = patterns
    kinds = Counter(f"{type(m).__module__.split('.')[-2]}.{type(m).__name__}" for m in layers.values())
    params = parameter_counts(model)  # the report's own counter (4-bit packed weights counted unpacked)
    summary = (f"{len(layers)} LoRA layers: {', '.join(f'{k} x{v}' for k, v in patterns.items())} "
               f"({', '.join(kinds)})")
    head_text, head_problems = _head_problems(model, decision, trainer, outcome)
    problems += head_problems
    summary += f"; {head_text}" if head_text else ""
    summary += f"; only adapters{' and the head' if head_text else ''} train: {params.trainable:,} of {params.total:,} parameters"
    if decision.settings.quantization == "4bit":
        summary += "; base weights Params4bit"
    if problems:
        return False, f"{summary}; but {'; '.join(problems)}"
    return True, summary


def _problems(model, decision: Decision, layers) -> list[str]:
    st = decision.settings
    out = []
    if not layers:
        out.append("no LoRA layer found")
    missing = unwrapped_targets(model, st.target_modules)
    if missing:
        out.append(f"{len(missing)} target layer(s) not wrapped, e.g. {missing[:3]}")
    experts = unwrapped_parameters(model, st.target_parameters)
    if experts:
        out.append(f"{len(experts)} expert weight(s) without an adapter, e.g. {experts[:3]}")
    if st.in_blocks:
        inside = {id(m) for b in find_blocks(model) for m in b.modules()}
        outside = [n for n, m in layers.items() if id(m) not in inside]
        if outside:
            out.append(f"{len(outside)} adapter(s) outside the blocks, e.g. {outside[:3]}")
    extra = non_adapter_trainables(model)
    if extra:
        out.append(f"{len(extra)} base parameter(s) still train, e.g. {extra[:3]}")
    want = {"4bit": "Params4bit", "8bit": "Int8Params"}.get(st.quantization)
    if want:
        wrong = [n for n, m in layers.items() if not _quantized_base(m.get_base_layer(), want)]
        if wrong:
            out.append(f"{len(wrong)} adapted layer(s) have no {want} base weight, e.g. {wrong[:3]}")
    return out
