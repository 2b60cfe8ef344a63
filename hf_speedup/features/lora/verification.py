"""``verify`` for LoRA: adapters where planned and nowhere else, only they (and a new head) train, k-bit bases."""

from __future__ import annotations

from collections import Counter

from ...blocks import find_blocks
from ...model_info import parameter_counts
from ...plan_types import Decision, Outcome
from .heads import _head_problems
from .targets import adapter_patterns, lora_layers, unwrapped_parameters, unwrapped_targets


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


def non_adapter_trainables(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n and "modules_to_save" not in n]


def _quantized_base(base, want: str) -> bool:
    if type(base.weight).__name__ == want:
        return True
    # FSDP2 turns each Params4bit into a DTensor; bitsandbytes keeps the quant state on the module for that
    return (want == "Params4bit" and type(base).__name__ == "Linear4bit"
            and getattr(base, "quant_state", None) is not None)
