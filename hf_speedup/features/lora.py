"""LoRA / QLoRA through peft: adapters on every projection of the repeated block, base frozen.

Target modules (``lora.target_modules``):

- ``auto``: every linear layer (``nn.Linear``, or transformers' ``Conv1D`` as in GPT-2) inside the repeated
  decoder block (for Llama q, k, v, o, gate, up, down — the QLoRA paper's finding that adapting all
  projections matches full fine-tuning; peft's own default mapping only adapts q and v). peft's mapping is
  used only where no block is found.
- ``all-linear``: peft's own rule (every Linear but the output head); or an explicit list.

QLoRA (``quantization: 4bit``) needs a 4-bit NF4 base, and quantization happens **at load time**
(``hf_speedup.load_model`` or ``from_pretrained(quantization_config=BitsAndBytesConfig(...))``); a
model handed to the trainer is never re-quantized. When it cannot be had — no bitsandbytes/CUDA
here, or the model given is not quantized — the plan falls back to plain LoRA, records why in
``fallbacks`` and logs a warning; with ``lora.strict: true`` it raises instead. We chose an explicit
fallback over an error for the unquantized model so ``speedup="qlora"`` runs anywhere, the way it
does on a CPU; ``strict`` is the switch for "I need the memory saving or nothing".

A model that is not a transformers causal LM (a plain ``nn.Module``, an encoder) gets peft's generic
PeftModel (its own forward and loss). A model that already is a PeftModel keeps its adapters (reported,
never wrapped twice). A model loaded from a GGUF file is trainable once its stale quantizer flag is cleared
(see :func:`hf_speedup.gguf.clear_stale_gguf_quantizer`).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

from torch import nn

from ..blocks import find_blocks
from ..config import SpeedupConfigError
from ..gguf import clear_stale_gguf_quantizer
from ..model_info import is_linear_layer, parameter_counts, quantization_of
from ..plan_types import OFF, Decision, Outcome, PlanContext

NAME = "lora"
APPLIES_TO = "model"
logger = logging.getLogger("hf_speedup")

_BITS = {"4bit": "qlora", "8bit": "lora-8bit"}
_LOADERS = "hf_speedup.load_model(name_or_path, speedup=...)"


@dataclass(frozen=True)
class Settings:
    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: tuple[str, ...] | str = "all-linear"  # names, or peft's "all-linear"
    quantization: str | None = None  # the base's k-bit form: 4bit (QLoRA) | 8bit | None
    existing: bool = False  # the model already is a PeftModel: its adapters are kept
    gguf: bool = False  # a GGUF base, dequantized at load


# ----------------------------------------------------------------------------------------- decide
def resolve_targets(ctx: PlanContext) -> tuple[list[str] | str, str]:
    """(target modules, where they came from) for ``lora.target_modules``."""
    asked = ctx.config.lora.target_modules
    if asked != "auto":
        return (list(asked) if isinstance(asked, (list, tuple)) else asked), "as configured"
    info = ctx.model
    if info is not None and info.linear_names:
        return list(info.linear_names), f"every linear layer in the repeated {info.block_class}"
    if info is not None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_MAP

        if info.model_type in PEFT_MAP:
            return list(PEFT_MAP[info.model_type]), f"peft's default for model_type {info.model_type!r}"
    if info is not None and info.model_type == "unknown":  # not a transformers model: peft sees no output head
        return "all-linear", "peft's all-linear (every linear layer: this model has no transformers config naming its head)"
    return "all-linear", "peft's all-linear (every Linear but the output head)"


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
    bits, reason, fallbacks = _decide_quantization(ctx)
    gguf = info is not None and info.quantization == "gguf"
    reason = f"LoRA r={s.r}, alpha={s.alpha} on {_fmt(targets)} ({source})" + reason
    if gguf:
        reason += "; GGUF base: dequantized at load, its stale quantizer flag is cleared so the Trainer accepts it"
    settings = Settings(r=s.r, alpha=s.alpha, dropout=s.dropout, quantization=bits, gguf=gguf,
                        target_modules=targets if isinstance(targets, str) else tuple(targets))
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

    targets = decision.settings.target_modules
    targets = targets if isinstance(targets, str) else list(targets)
    matched = _check_targets(model, targets)
    if quantization_of(model) in ("4bit", "8bit"):
        # Checkpointing is the checkpointing feature's job (applied next, per block, non-reentrant):
        # peft's own switch would enable it on every block, reentrant, a second time.
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    st = decision.settings
    task_type, task_note = _task_type(model)
    if task_note:
        outcome.notes.append(task_note)
    # Conv1D (GPT-2) stores its weight transposed: peft must be told, or it warns and flips it per layer
    fan_in_fan_out = bool(matched) and all(type(m).__name__ == "Conv1D" for m in matched)
    config = LoraConfig(r=st.r, lora_alpha=st.alpha, lora_dropout=st.dropout, target_modules=targets, bias="none",
                        task_type=task_type, fan_in_fan_out=fan_in_fan_out)
    try:
        setup.model = get_peft_model(model, config)
    except ValueError as exc:  # peft's "Target modules ... not found" and the like: name the field and the fix
        raise SpeedupConfigError([
            f"lora.target_modules = {targets!r}: peft could not adapt this {type(model).__name__} ({exc}); allowed: "
            f"the names of its linear layers {sorted(_linear_leaves(model))}; fix: set lora.target_modules: "
            "[names] from that list"]) from None
    logger.info("hf_speedup: LoRA (%s) on %s", decision.applied, _fmt(targets))


def _task_type(model) -> tuple[str | None, str]:
    """peft's task type for this model: a causal LM gets PeftModelForCausalLM; any other module (a plain
    ``nn.Module``, an encoder) the generic PeftModel, whose forward is the model's own."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "is_encoder_decoder", False):
        return "SEQ_2_SEQ_LM", ""
    if callable(getattr(model, "prepare_inputs_for_generation", None)):
        return "CAUSAL_LM", ""
    return None, (f"{type(model).__name__} is not a transformers causal LM: adapters added through peft's generic "
                  "PeftModel (the model's own forward and loss)")


def _linear_leaves(model) -> set[str]:
    return {n.split(".")[-1] for n, m in model.named_modules() if n and is_linear_layer(m)}


def _check_targets(model, targets) -> list:
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
        raise SpeedupConfigError([
            f"lora.target_modules = {list(targets)!r}: {missing} match no Linear layer (nn.Linear, transformers "
            f"Conv1D) of this {type(model).__name__}; allowed: {leaves}, 'auto' or 'all-linear'; fix: set "
            "lora.target_modules: auto, or names from that list"
        ])
    return [m for n, m in layers if any(n == t or n.endswith("." + t) for t in targets)]


# ----------------------------------------------------------------------------------------- verify
def lora_layers(model) -> dict[str, nn.Module]:
    """Name -> peft LoRA layer (``lora.Linear`` and its bitsandbytes variants)."""
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


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


def non_adapter_trainables(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n and "modules_to_save" not in n]


def _quantized_base(base, want: str) -> bool:
    if type(base.weight).__name__ == want:
        return True
    # FSDP2 turns each Params4bit into a DTensor; bitsandbytes keeps the quant state on the module for that
    return (want == "Params4bit" and type(base).__name__ == "Linear4bit"
            and getattr(base, "quant_state", None) is not None)


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
    counts = Counter(n.split(".")[-1] for n in layers)
    kinds = Counter(f"{type(m).__module__.split('.')[-2]}.{type(m).__name__}" for m in layers.values())
    params = parameter_counts(model)  # the report's own counter (4-bit packed weights counted unpacked)
    summary = (f"{len(layers)} LoRA layers ({', '.join(f'{k}x{v}' for k, v in counts.items())}; "
               f"{', '.join(kinds)}); only adapters train: {params.trainable:,} of {params.total:,} parameters")
    if decision.settings.quantization == "4bit":
        summary += "; base weights Params4bit"
    if problems:
        return False, f"{summary}; but {'; '.join(problems)}"
    return True, summary


def _problems(model, decision: Decision, layers) -> list[str]:
    out = []
    if not layers:
        out.append("no LoRA layer found")
    missing = unwrapped_targets(model, decision.settings.target_modules)
    if missing:
        out.append(f"{len(missing)} target layer(s) not wrapped, e.g. {missing[:3]}")
    extra = non_adapter_trainables(model)
    if extra:
        out.append(f"{len(extra)} base parameter(s) still train, e.g. {extra[:3]}")
    want = {"4bit": "Params4bit", "8bit": "Int8Params"}.get(decision.settings.quantization)
    if want:
        wrong = [n for n, m in layers.items() if not _quantized_base(m.get_base_layer(), want)]
        if wrong:
            out.append(f"{len(wrong)} adapted layer(s) have no {want} base weight, e.g. {wrong[:3]}")
    return out
