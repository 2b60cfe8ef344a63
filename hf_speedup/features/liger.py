"""Liger kernels (Triton: RMSNorm, RoPE, SwiGLU/GEGLU, fused linear cross-entropy) through transformers' own
switch, ``TrainingArguments.use_liger_kernel``: the Trainer patches the model when ``train()`` starts.

``auto`` (fast and memory presets) turns them on where they run: a CUDA device, ``liger-kernel`` installed
and a model type Liger knows. On CPU they are off with that reason (Triton kernels need a GPU). Which kernels a
model family gets, and which are on by default, is read from Liger's own ``apply_liger_kernel_to_<type>``
signature (:func:`kernel_switches`). Where the blocks are compiled (the compile feature decides first), only
Liger's loss kernels are applied (``liger_kernel_config`` switches the layer kernels off): inductor fuses norms,
rotary and gated MLPs itself, and Liger's Triton autograd functions inside a compiled block fail dynamo's trace
(torch 2.11, liger-kernel 0.8.5 on an H200: every block fell back to eager). Verified on the live model once
training has started: Liger's module classes in the blocks, its rotary function in the modeling module, its
fused-loss forward on the model, its cross-entropy in torch.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
import sys
from dataclasses import dataclass, replace

from ..blocks import unwrap_model
from ..compat import is_trl_sft_config
from ..config import SpeedupConfigError
from ..plan_types import OFF, Decision, Outcome, PlanContext

NAME = "liger"
PACKAGE = "liger_kernel"
logger = logging.getLogger("hf_speedup")


# the kernel switches of Liger's apply_liger_kernel_to_<model> functions (each takes the ones its model has;
# transformers drops the names it does not take): the layer kernels run inside the decoder blocks, the loss kernels
# at the head
LAYER_KERNELS = ("rms_norm", "rope", "swiglu", "geglu", "layer_norm", "relu_squared")
LOSS_KERNEL = "fused_linear_cross_entropy"
LOSS_KERNELS = (LOSS_KERNEL, "cross_entropy")  # cross_entropy still computes the full logits
LLAMA_SWITCHES = {"rope": True, "cross_entropy": False, LOSS_KERNEL: True, "rms_norm": True, "swiglu": True}


@dataclass(frozen=True)
class Settings:
    enabled: bool = False
    model_type: str | None = None
    kernel_config: tuple[tuple[str, bool], ...] = ()  # TrainingArguments.liger_kernel_config, where we set it
    loss_by: str | None = None  # who computes the loss without the full logits: "liger" | "trl" (its fused head)


def fused_loss_elsewhere(decision: Decision | None) -> bool:
    """Liger's fused linear cross-entropy, or TRL's fused LM head (Liger on under TRL's SFTTrainer), computes the
    loss: no full logits, and the chunked loss stays out. A user's liger_kernel_config may leave Liger on without
    its loss: then neither."""
    return decision is not None and decision.active and getattr(decision.settings, "loss_by", None) is not None


def installed() -> bool:
    """liger-kernel importable here (tests fake it)."""
    return importlib.util.find_spec(PACKAGE) is not None


def apply_functions() -> dict | None:
    """Liger's apply function per model type (None where liger-kernel does not import; tests fake it)."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except Exception:  # not installed, or no GPU stack to import it with
        return None
    return dict(MODEL_TYPE_TO_APPLY_LIGER_FN)


def supported_model_types() -> frozenset[str] | None:
    """Model types Liger can patch (None where liger-kernel cannot tell, e.g. it does not import)."""
    functions = apply_functions()
    return None if functions is None else frozenset(functions)


def kernel_switches(model_type: str | None) -> dict[str, bool]:
    """The kernels Liger patches for this model type and which are on unless told otherwise, from its
    ``apply_liger_kernel_to_<type>`` signature: families differ (Gemma's GEGLU, Nemotron's squared ReLU, Granite's
    plain cross-entropy instead of the fused one, DeepSeek's stock RoPE). Llama's where liger-kernel cannot tell."""
    function = (apply_functions() or {}).get(model_type)
    if function is None:
        return dict(LLAMA_SWITCHES)
    parameters = inspect.signature(function).parameters
    named = {n: p.default for n, p in parameters.items() if isinstance(p.default, bool) and n in (*LAYER_KERNELS,
                                                                                                    *LOSS_KERNELS)}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        # a vision-language wrapper (LLaVA) hands the rest to its text model's function: Llama-style kernels
        named = {**{k: v for k, v in LLAMA_SWITCHES.items() if k in LAYER_KERNELS}, **named}
    return named


def _on(switches: dict[str, bool], names=(*LAYER_KERNELS, *LOSS_KERNELS)) -> list[str]:
    return [k for k in names if switches.get(k)]


def decide(ctx: PlanContext) -> Decision:
    asked, caps, info = ctx.config.liger.enabled, ctx.caps, ctx.model
    model_type = info.model_type if info is not None else None
    settings = Settings(model_type=model_type)

    def off(why: str) -> Decision:
        fallbacks = (f"liger: {why}",) if asked is True else ()
        for fb in fallbacks:
            logger.warning("hf_speedup fallback: %s", fb)
        return Decision(NAME, requested=asked, applied=OFF, reason=why, settings=settings, fallbacks=fallbacks)

    if asked is False:
        return Decision(NAME, requested=asked, applied=OFF, reason="off in the config", settings=settings)
    if not caps.is_cuda:
        return off(f"Liger's Triton kernels run on CUDA GPUs; this is {caps.device_type}: off")
    if not installed():
        return off("liger-kernel is not installed (pip install liger-kernel): off")
    types = supported_model_types()
    if model_type is not None and types is not None and model_type not in types:
        return off(f"Liger has no kernels for model type {model_type!r}: off")
    if ctx.args is not None and getattr(ctx.args, "use_liger_kernel", False):
        reason = "TrainingArguments.use_liger_kernel=True already; "
    else:
        reason = ""
    users = getattr(ctx.args, "liger_kernel_config", None)
    compiled = _blocks_compiled(ctx) and not users
    trl = is_trl_sft_config(ctx.args)
    switches = kernel_switches(model_type)
    layers_off = tuple((k, False) for k in LAYER_KERNELS)
    if trl and LOSS_KERNEL in switches:  # its trainer turns the fused loss off: its own fused LM head computes it
        switches[LOSS_KERNEL] = False
    if compiled and not _on(switches, LOSS_KERNELS):
        why = ("TRL's SFTTrainer applies only Liger's layer kernels" if trl else
               f"Liger's kernels for {model_type!r} are its layer kernels only")
        why += (f" ({', '.join(_on(switches))}), and the blocks are compiled: inductor fuses those ops itself, and "
                "Liger's Triton autograd functions inside a compiled block fail dynamo's trace (every block would "
                "run eager): off (liger_kernel_config switches every kernel off, so a use_liger_kernel=True already in "
                f"the {'SFTConfig' if trl else 'TrainingArguments'} patches nothing)")
        decision = off(why)
        everything_off = layers_off + tuple((k, False) for k in LOSS_KERNELS)
        return replace(decision, settings=Settings(model_type=model_type, kernel_config=everything_off))
    if users:  # the user's own liger_kernel_config: what it leaves on over this model's defaults
        merged = {**switches, **{k: v for k, v in dict(users).items() if k in switches and not (trl and k ==
                                                                                                 LOSS_KERNEL)}}
        on = _on(merged)
        if merged.get("cross_entropy") and merged.get(LOSS_KERNEL):
            raise SpeedupConfigError([
                f"TrainingArguments.liger_kernel_config = {dict(users)!r}: with {model_type!r}'s defaults it switches "
                "on both cross_entropy and fused_linear_cross_entropy, which Liger refuses when train() starts "
                "(\"cannot both be True\"); allowed: one of them; fix: add \"fused_linear_cross_entropy\": False, or "
                "drop \"cross_entropy\": True"])
        if not on:
            return off(f"TrainingArguments.liger_kernel_config={dict(users)!r} switches every kernel {model_type!r} "
                       "has off: off")
        reason += f"Liger kernels as TrainingArguments.liger_kernel_config={dict(users)!r} leaves them: {', '.join(on)}"
        loss_by = "trl" if trl else ("liger" if merged.get(LOSS_KERNEL) else None)
        return Decision(NAME, requested=asked, applied=",".join(on), reason=reason,
                        settings=Settings(enabled=True, model_type=model_type, loss_by=loss_by))
    if compiled:
        loss = _on(switches, LOSS_KERNELS)
        left = _on(switches, LAYER_KERNELS)
        reason += (f"Liger's {' and '.join(loss)} only"
                   f"{' (the full logits are never stored)' if LOSS_KERNEL in loss else ''}, via "
                   f"{'SFTConfig' if trl else 'TrainingArguments'}.use_liger_kernel with liger_kernel_config; its "
                   f"layer kernels ({', '.join(left) or 'none'}) left out: the blocks are compiled, inductor fuses "
                   "those ops itself, and Liger's Triton autograd functions inside a compiled block fail dynamo's "
                   "trace (every block would run eager)")
        return Decision(NAME, requested=asked, applied=",".join(loss), reason=reason,
                        settings=Settings(enabled=True, model_type=model_type, kernel_config=layers_off,
                                          loss_by="trl" if trl else ("liger" if LOSS_KERNEL in loss else None)))
    if not _on(switches):
        return off(f"Liger has no kernel switched on for {model_type!r}{' under TRL' if trl else ''}: off")
    if trl:
        reason += (f"Liger's {', '.join(_on(switches))} via SFTConfig.use_liger_kernel; TRL's SFTTrainer turns "
                   "Liger's fused linear cross-entropy off, its own fused LM head computes the loss without the "
                   "full logits (TRL 1.16 marks use_liger_kernel deprecated, for Hub kernels)")
        applied, loss_by = ",".join(_on(switches)), "trl"
    else:
        on = _on(switches)
        reason += (f"Liger's {', '.join(on)}{' (the full logits are never stored)' if LOSS_KERNEL in on else ''} via "
                   "TrainingArguments.use_liger_kernel; transformers patches the model when train() starts")
        applied, loss_by = ",".join(on), ("liger" if LOSS_KERNEL in on else None)
    return Decision(NAME, requested=asked, applied=applied, reason=reason,
                    settings=Settings(enabled=True, model_type=model_type, loss_by=loss_by))


def _blocks_compiled(ctx: PlanContext) -> bool:
    """The compile feature (deciding before this one) compiles the decoder blocks."""
    compiled = ctx.decisions.get("compile")
    return compiled is not None and compiled.active


def training_args(decision: Decision, args) -> dict:
    kernels = getattr(decision.settings, "kernel_config", ())
    out = {"liger_kernel_config": dict(kernels)} if kernels else {}
    return {"use_liger_kernel": True, **out} if decision.active else out


def apply(decision: Decision, setup, outcome: Outcome) -> None:
    """Nothing here: the Trainer applies Liger at the start of ``train()`` (``use_liger_kernel``)."""


def _from_liger(fn) -> bool:
    """Through the wrappers ``accelerator.prepare`` puts around a model's forward under mixed precision (autocast,
    outputs to fp32): they keep the wrapped function as ``__wrapped__``, and only the innermost one is Liger's."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        fn = getattr(fn, "__func__", fn)
        if (getattr(fn, "__module__", "") or "").startswith(PACKAGE):
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _patched_by_liger(module) -> bool:
    """Liger patches a live model by binding its forwards onto the instances (the class stays stock); models
    built after that get its module classes."""
    return type(module).__module__.startswith(PACKAGE) or _from_liger(module.__dict__.get("forward"))


def liger_parts(model) -> dict[str, int | bool]:
    """What of Liger is in the live model: patched block-module count, rotary function, fused-loss forward."""
    base = unwrap_model(model)
    modules = sum(1 for m in base.modules() if m is not base and _patched_by_liger(m))
    modeling = sys.modules.get(type(base).__module__)
    import torch

    return {"modules": modules, "rope": _from_liger(getattr(modeling, "apply_rotary_pos_emb", None)),
            "fused_loss": _from_liger(getattr(base, "forward", None)),
            "cross_entropy": _from_liger(torch.nn.functional.cross_entropy)}  # Liger patches torch's own


def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    if not decision.active:
        return False, decision.reason
    if not getattr(trainer.args, "use_liger_kernel", False):
        return False, "args.use_liger_kernel=False - MISMATCH: planned True"
    parts = liger_parts(trainer.model)
    if not any(parts.values()):
        return False, "args.use_liger_kernel=True; not patched yet (transformers applies Liger when train() starts)"
    loss_text = ("fused linear cross-entropy" if parts["fused_loss"] else
                 "Liger cross-entropy" if parts["cross_entropy"] else "stock")
    rotary = "Liger" if parts["rope"] else "stock"
    text = f"{parts['modules']} Liger module(s) in the model, rotary {rotary}, loss {loss_text}"
    planned = (getattr(decision, "applied", None) or ",".join(_on(LLAMA_SWITCHES))).split(",")
    layers = [k for k in planned if k in LAYER_KERNELS]
    if layers:
        return parts["modules"] > 0 or (layers == ["rope"] and parts["rope"]), text
    # layer kernels left out on purpose (compiled blocks, the user's config) must not be there either
    loss_seen = all(parts[key] for kernel, key in ((LOSS_KERNEL, "fused_loss"), ("cross_entropy", "cross_entropy"))
                    if kernel in planned)
    return parts["modules"] == 0 and loss_seen, text
