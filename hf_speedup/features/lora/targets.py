"""peft's names and paths: which layers and expert weights get adapters, checked on the live model, read back.

For ``decide``, the target modules and fused expert parameters ``lora.target_modules`` names; for ``apply``, the
check that they exist in the model and the expression that keeps peft inside the repeated blocks; for ``verify``,
the LoRA layers peft made, by what each adapts (``model.layers.*.self_attn.q_proj``), and the targets it missed.
"""

from __future__ import annotations

import re
from collections import Counter

from torch import nn

from ...blocks import find_blocks, unwrap_model
from ...config import SpeedupConfigError
from ...model_info import is_linear_layer
from ...plan_types import PlanContext


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
        renamed = peft_renamed(info.model_type) & set(info.linear_names)
        why = f"every linear layer in the repeated {info.block_class}{but}, inside the blocks only"
        if renamed:
            why += (f"; not its {', '.join(sorted(renamed))} layers (dense blocks' MLPs, shared experts): peft turns "
                    f"those names into the fused expert weights for model type {info.model_type!r} (its conversion "
                    "of transformers-v4 adapters), so adapters there would be neither made nor reloaded; they stay "
                    "frozen")
        return [n for n in info.linear_names if n not in renamed], why
    if info is not None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_MAP

        if info.model_type in PEFT_MAP:
            return list(PEFT_MAP[info.model_type]), f"peft's default for model_type {info.model_type!r}"
    if info is not None and info.model_type == "unknown":  # not a transformers model: peft sees no output head
        return "all-linear", "peft's all-linear (every linear layer: this model has no transformers config naming its head)"
    return "all-linear", "peft's all-linear (every Linear but the output head)"


def peft_renamed(model_type: str | None) -> set[str]:
    """Layer names peft (0.21 on transformers 5) rewrites into fused expert weights for this model type before it
    adapts anything: ``gate_proj``/``up_proj``/``down_proj`` become ``experts.gate_up_proj``/``experts.down_proj``
    for DeepSeek-V3, Qwen3-MoE, OLMoE, GLM-4-MoE and the other Qwen2-MoE-converted types, whatever module really has
    the name (a dense block's MLP, a shared expert). Empty where peft does not (or no longer) do this."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except Exception:  # older peft, or transformers 4
        return set()
    base = getattr(conversion, "_MODEL_TO_CONVERSION_PATTERN", {}).get(model_type)
    mapping = getattr(conversion, "_MOE_TARGET_MODULE_MAPPING", {}).get(base) or {}
    fused = getattr(conversion, "_MOE_FUSED_TARGETS", {}).get(base)
    checkpoint = getattr(conversion, "get_checkpoint_conversion_mapping", lambda _: None)
    try:
        converts = bool(mapping and fused) and checkpoint(model_type) is not None
    except Exception:
        converts = False
    return {name for name, new in mapping.items() if converts and not name.endswith("gate") and new != "gate.weight"}


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
