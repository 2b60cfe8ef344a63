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

The modules: ``targets`` (peft's names and paths: what gets adapters, checked and read back), ``heads`` (the task
head: peft's task type, ``modules_to_save``) and ``verification`` (``verify``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ...config import SpeedupConfigError
from ...gguf import clear_stale_gguf_quantizer
from ...model_info import quantization_of
from ...plan_types import OFF, Decision, Outcome, PlanContext
from .heads import _head, _live_head, _saveable_heads
from .targets import (_check_parameters, _check_targets, _in_blocks, _linear_leaves, resolve_parameters,
                      resolve_targets)
# the feature's verify, and what other code reads from the feature: tests' lora_layers and adapter_patterns
from .targets import adapter_patterns, lora_layers  # noqa: F401
from .verification import verify  # noqa: F401
from .adopt import attach, prepare, remember_wrapper, wrapper_of  # noqa: F401  (the trainer's own LoRA; reuse)

NAME = "lora"
APPLIES_TO = "model"
logger = logging.getLogger("hf_speedup")

_BITS = {"4bit": "qlora", "8bit": "lora-8bit"}
_LOADERS = "hf_speedup.load_model(name_or_path, speedup=...)"
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
    allowed = sorted(_linear_leaves(model))  # read before peft, which may have wrapped some layers when it fails
    try:
        setup.model = get_peft_model(model, config)
        remember_wrapper(setup.model)
    except ValueError as exc:  # peft's "Target modules ... not found" and the like: name the field and the fix
        if "dropout" in str(exc):
            raise SpeedupConfigError([
                f"lora.dropout = {st.dropout!r}: peft could not adapt this {type(model).__name__} ({exc}); allowed: "
                "0 where adapters sit on fused expert weights; fix: set lora.dropout: 0"]) from None
        raise SpeedupConfigError([
            f"lora.target_modules = {targets!r}: peft could not adapt this {type(model).__name__} ({exc}); allowed: "
            f"the names of its linear layers {allowed}; fix: set lora.target_modules: [names] from that list"]) \
            from None
    logger.info("hf_speedup: LoRA (%s) on %s", decision.applied, _fmt(targets))
