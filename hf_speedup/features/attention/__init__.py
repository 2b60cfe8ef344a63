"""The attention kernel: ``config._attn_implementation`` chosen per device, dtype and packing, set through
transformers' own switch (``set_attn_implementation``) and read back from the live model.

``auto`` ranks what can run here, best first:

- CUDA: ``flash_attention_3`` (Hopper, flash-attn 3 installed), ``flash_attention_2`` (Ampere+, flash-attn
  installed) — both need bf16/fp16 and take padding-free rows as ``cu_seqlens`` — then ``sdpa``;
- CPU with padding-free rows: ``sdpa_varlen`` (:mod:`.sdpa_varlen`: each sequence on torch's CPU flash
  kernel, no cross-sequence blocks, no ``T x T`` mask), then ``sdpa`` (a block-diagonal mask);
- CPU otherwise: ``sdpa``; ``eager`` only where a model has nothing better;
- CPU, where the door measured it faster (:mod:`.door`: forward + backward at the model's shapes, length and
  dtype): ``blocked`` (:mod:`.blocked`: hf_speedup's C++ kernel, large GEMMs per block of queries) ahead of both.

``flex_attention`` is taken only when asked for, and never for CPU training (torch has no CPU backward for
it). The model's own features count: ``sdpa`` and ``sdpa_varlen`` need the class's ``_supports_sdpa`` and no
attention-logit softcapping (Gemma 2's ``attn_logit_softcapping``: SDPA cannot apply it, flash-attention and
flex_attention can); ``sdpa_varlen`` also needs full (not sliding-window) attention and one head size for
queries, keys and values (not DeepSeek's latent attention, whose values are narrower); the flash kernels need
``_supports_flash_attn``, ``flex_attention`` ``_supports_flex_attn``. A kernel asked for that cannot run here falls back along the same ranking, listed in ``fallbacks``;
with ``attention.strict`` it is an error instead. ``keep`` (the baseline) leaves the model's own choice.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

from ...blocks import unwrap_model
from ...config import SpeedupConfigError
from ...plan_types import OFF, Decision, Outcome, PlanContext
from .. import sequence_parallel
from . import blocked, sdpa_varlen
from .door import MEASURED, measure, measured_form  # noqa: F401  (measure: the door's hook, plan.measure calls it)

NAME = "attention"
logger = logging.getLogger("hf_speedup")

FLASH = ("flash_attention_3", "flash_attention_2")
PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
MARGIN = 0.1  # the blocked kernel is taken where it measured > 10% faster than torch's
KERNELS = ("sdpa", "sdpa_varlen", "blocked", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")


@dataclass(frozen=True)
class Settings:
    implementation: str | None = None  # set on the model; None keeps it
    previous: str | None = None  # the model's own when the plan was made
    packed: bool = False  # the data feature makes padding-free rows
    dtype: str = "fp32"
    strict: bool = False  # attention.strict: a kernel the model refuses at apply is an error, not a fallback
    form: str | None = None  # blocked's form as the door measured fastest: tiles "QxK" or "bmm" (None: defaults)


# transformers' own checks: the distribution's name (flash-attn-4 also installs ``flash_attn``), its version
# and a device; what they accept is what ``set_attn_implementation`` loads
TRANSFORMERS_CHECKS = {"flash_attn": "is_flash_attn_2_available", "flash_attn_interface": "is_flash_attn_3_available"}


def installed(package: str) -> bool:
    """Whether transformers would load this kernel package here (tests fake it)."""
    from transformers.utils import import_utils

    check = getattr(import_utils, TRANSFORMERS_CHECKS.get(package, ""), None)
    if check is not None:
        return bool(check())
    return importlib.util.find_spec(package) is not None


# --------------------------------------------------------------------------------------------- decide
def usable(name: str, caps, info, dtype: str, packed: bool) -> tuple[bool, str]:
    """(can ``name`` train this model here, why not)."""
    kernels = info.attention_kernels
    if name in FLASH:
        if "flash_attention" not in kernels:
            return False, f"{info.architecture} has no flash-attention support"
        if not caps.is_cuda:
            return False, f"{name} runs on CUDA GPUs; this is {caps.device_type}"
        cc = caps.compute_capability or (0, 0)
        if name == "flash_attention_3" and caps.rocm:
            return False, "flash_attention_3 needs an NVIDIA Hopper GPU; this is an AMD GPU (ROCm)"
        if name == "flash_attention_3" and cc[0] != 9:
            return False, f"flash_attention_3 needs a Hopper GPU (compute capability 9.x); this is {cc[0]}.{cc[1]}"
        if name == "flash_attention_2" and cc < (8, 0):
            return False, f"flash_attention_2 needs compute capability >= 8.0; this is {cc[0]}.{cc[1]}"
        if dtype not in ("bf16", "fp16"):
            return False, f"{name} computes in bf16/fp16 and the plan trains in {dtype}"
        if not installed(PACKAGES[name]):
            pkg = "flash-attn >= 2.3.3" if name == "flash_attention_2" else "flash-attn-3"
            return False, f"{name}: the {pkg} package is not installed (or transformers does not accept it here)"
        return True, ""
    if name == "flex_attention":
        if "flex_attention" not in kernels:
            return False, f"{info.architecture} has no flex_attention support"
        if caps.device_type == "cpu":
            return False, "torch's flex_attention has no backward on CPU, so it cannot train here"
        return True, ""
    if name in ("sdpa", "sdpa_varlen", "blocked"):  # blocked's calls it cannot serve go through sdpa
        cap = getattr(info, "attention_softcap", None)
        if cap:
            return False, (f"{info.architecture} caps its attention logits (attn_logit_softcapping={cap:g}), which "
                           "torch's scaled_dot_product_attention cannot apply")
        if "sdpa" not in kernels:
            return False, f"{info.architecture} has no sdpa support (_supports_sdpa is False)"
    if name == "blocked":
        if caps.device_type != "cpu":
            return False, f"blocked is hf_speedup's CPU kernel; this is {caps.device_type}"
        if dtype not in ("fp32", "bf16"):
            return False, f"blocked computes in fp32 or bf16 and the plan trains in {dtype}"
    if name in ("sdpa_varlen", "blocked"):
        if caps.device_type != "cpu":
            return False, f"sdpa_varlen runs torch's CPU flash kernel; this is {caps.device_type}"
        if getattr(info, "sliding_window", None):
            return False, (f"{info.architecture} attends within a sliding window of {info.sliding_window} tokens; "
                           f"{name} computes full causal attention per sequence")
        if getattr(info, "value_head_dim", None):
            return False, (f"{info.architecture}'s values are {info.value_head_dim} wide, narrower than its queries "
                           "and keys; torch's CPU flash kernel needs one head size")
    return True, ""


def ranking(caps, packed: bool) -> list[str]:
    if caps.is_cuda:
        return ["flash_attention_3", "flash_attention_2", "sdpa", "eager"]
    faster = ["blocked"] if measured_faster(caps) else []
    if caps.device_type == "cpu" and packed:
        return [*faster, "sdpa_varlen", "sdpa", "eager"]
    return [*faster, "sdpa", "eager"]


def _timings(caps) -> dict:
    m = caps.measured.get(MEASURED)
    return dict(m.value) if m is not None and isinstance(m.value, dict) else {}


def measured_faster(caps) -> bool:
    """The door timed the blocked kernel faster than torch's CPU flash kernel at this run's shapes, by more than
    ``MARGIN`` (a closer figure is within the noise of a shared machine: torch's kernel is kept)."""
    t = _timings(caps)
    mine, torch_ = t.get("blocked"), t.get("sdpa_varlen")
    return isinstance(mine, float) and isinstance(torch_, float) and mine < torch_ * (1 - MARGIN)


def measured_text(caps) -> str:
    """The door's figure, as the reason quotes it (empty where nothing was measured)."""
    t = _timings(caps)
    if not t:
        return ""
    parts = [f"{k} {v * 1e3:.1f} ms" if isinstance(v, float) else f"{k}: {v}" for k, v in t.items()]
    mine, torch_ = t.get("blocked"), t.get("sdpa_varlen")
    ratio = f"blocked {torch_ / mine:.2f}x torch's CPU flash kernel; " if isinstance(mine, float) and \
        isinstance(torch_, float) else ""
    return f"measured {ratio}{', '.join(parts)} ({caps.measured[MEASURED].text()})"


WHY = {
    "flash_attention_3": "FlashAttention-3 (Hopper): fastest exact attention; padding-free rows as cu_seqlens",
    "flash_attention_2": "FlashAttention-2: exact, memory-linear in length; padding-free rows as cu_seqlens",
    "sdpa_varlen": ("padding-free rows on CPU: each sequence through torch's CPU flash kernel (causal), no work "
                    "across sequences and no T x T mask (sdpa would compute the whole row and mask it)"),
    "blocked": ("hf_speedup's CPU kernel: grouped keys read in place, sequences of padding-free rows from the position "
                "ids; bf16 on AMX in tiles (oneDNN micro-kernels, an online softmax) or large GEMMs per block of 128 "
                "queries (ATen's bmm, a fused fp32 softmax), whichever the door timed faster"),
    "sdpa": "torch scaled_dot_product_attention",
    "eager": "the model's plain matmul-softmax attention",
    "flex_attention": "torch flex_attention (block-sparse masks, compiled by transformers)",
}


def _off(requested, reason: str, settings: Settings, fallbacks=()) -> Decision:
    return Decision(NAME, requested=requested, applied=OFF, reason=reason, settings=settings,
                    fallbacks=tuple(fallbacks))


def decide(ctx: PlanContext) -> Decision:
    cfg, caps, info = ctx.config.attention, ctx.caps, ctx.model
    asked = cfg.implementation
    data = ctx.decisions.get("data")
    packed = bool(data is not None and getattr(data.settings, "padding_free", False))
    prec = ctx.decisions.get("precision")
    dtype = prec.settings.name if prec is not None and prec.settings is not None else "fp32"
    current = info.attn_implementation if info is not None else None
    settings = Settings(previous=current, packed=packed, dtype=dtype)
    if asked == "keep":
        return _off(asked, f"keep: the model's own attention ({current or 'unknown'})", settings)
    if info is None:
        return _off(asked, "no model yet: the kernel is chosen when the trainer gets the model", settings)
    if "interface" not in info.attention_kernels:
        why = f"{info.architecture} cannot switch its attention kernel (no AttentionInterface dispatch); kept {current}"
        return _off(asked, why, settings, [f"attention: {why}"] if asked != "auto" else [])
    order = ranking(caps, packed)
    if (split := sequence_parallel.allowed_kernels(ctx)) is not None:  # an explicit other kernel was refused there
        order = [k for k in order if k in split] or list(split)
    fallbacks: list[str] = []
    if asked != "auto":
        ok, why = usable(asked, caps, info, dtype, packed)
        if ok:
            order = [asked]
        else:
            if cfg.strict:
                here = [k for k in KERNELS if usable(k, caps, info, dtype, packed)[0]]
                raise SpeedupConfigError([
                    f"attention.implementation = {asked!r} cannot run here ({why}) and attention.strict = true; "
                    f"allowed here: {', '.join(repr(k) for k in here)}, 'auto', 'keep'; fix: set "
                    "attention.implementation: auto, or attention.strict: false to fall back"])
            fallbacks.append(f"{asked} -> {{chosen}}: {why}")
    skipped = []
    for name in order:
        ok, why = usable(name, caps, info, dtype, packed)
        if ok:
            chosen = name
            break
        skipped.append((name, why))
    else:  # eager is always usable
        chosen = "eager"
    fallbacks = [f.format(chosen=chosen) for f in fallbacks]
    for fb in fallbacks:
        logger.warning("hf_speedup attention fallback: %s", fb)
    reason = f"{chosen}: {WHY[chosen]}"
    if asked == "auto" and skipped:
        grouped: dict[str, list[str]] = {}  # one reason once: "not sdpa_varlen, sdpa: ..."
        for name, why in skipped:
            grouped.setdefault(why, []).append(name)
        reason += " (not " + "; not ".join(f"{', '.join(names)}: {why}" for why, names in grouped.items()) + ")"
    if caps.device_type == "cpu" and (figure := measured_text(caps)) and chosen in ("blocked", "sdpa_varlen", "sdpa"):
        reason += f"; {figure}"
    if packed and chosen in ("sdpa", "eager"):
        reason += "; padding-free rows separated by a block-diagonal mask (the model's cache is kept off for them)"
    if current == chosen:
        reason += " - already the model's"
    return Decision(NAME, requested=asked, applied=chosen, reason=reason, fallbacks=tuple(fallbacks),
                    settings=Settings(implementation=chosen, previous=current, packed=packed, dtype=dtype,
                                      strict=bool(cfg.strict),
                                      form=measured_form(_timings(caps)) if chosen == "blocked" else None))


def training_args(decision: Decision, args) -> dict:
    return {}


# --------------------------------------------------------------------------------------------- apply
def apply(decision: Decision, setup, outcome: Outcome) -> None:
    """Set the kernel on the model (every sub-model follows); the flash kernels get cu_seqlens in the batch."""
    if not decision.active or setup.model is None or isinstance(setup.model, str):
        return
    name = decision.settings.implementation
    if name == sdpa_varlen.NAME:
        sdpa_varlen.register()
    if name == blocked.NAME:
        ok, why = blocked.load()
        if not ok:
            if decision.settings.strict:
                raise SpeedupConfigError([
                    f"attention.implementation = 'blocked': {why} and attention.strict = true; allowed: 'auto', "
                    "'sdpa_varlen', 'sdpa', 'keep'; fix: install gcc and ninja, or set attention.strict: false"])
            name = sdpa_varlen.NAME if decision.settings.packed else "sdpa"
            note = f"blocked -> {name}: {why}"
            outcome.fallbacks.append(note)
            outcome.applied = name
            outcome.facts["fell_back_to"] = name
            logger.warning("hf_speedup attention fallback: %s", note)
            if name == sdpa_varlen.NAME:
                sdpa_varlen.register()
        else:
            blocked.register()
            blocked.use(decision.settings.form)
            outcome.facts["build"] = why
            outcome.facts["calls_before"] = blocked.CALLS[0]
            outcome.facts["tiled_before"] = blocked.TILED[0]
    base = unwrap_model(setup.model)
    current = getattr(base.config, "_attn_implementation", None)
    if current != name:
        try:
            base.set_attn_implementation(name)
        except (ImportError, ValueError, RuntimeError, OSError) as exc:  # a flash-attn build that does not load,
            # or the hub kernel transformers fetches in its place cannot be downloaded
            why = str(exc).splitlines()[0] if str(exc) else repr(exc)
            if decision.settings.strict:
                raise SpeedupConfigError([
                    f"attention.implementation = {name!r}: transformers refused it on this model ({why}) and "
                    f"attention.strict = true; allowed: a kernel this install loads ({current!r} does), 'auto', "
                    "'keep'; fix: repair the kernel's install, or set attention.strict: false to fall back"]) from exc
            note = f"{name}: transformers refused it on this model ({why}); the model keeps {current}"
            outcome.fallbacks.append(note)
            outcome.applied = str(current)
            logger.warning("hf_speedup attention fallback: %s", note)
            return
    if name in FLASH and hasattr(setup.data_collator, "return_flash_attn_kwargs"):
        setup.data_collator.return_flash_attn_kwargs = True  # cu_seq_lens_q/k with each padding-free row
        outcome.facts["cu_seqlens"] = "in every batch (return_flash_attn_kwargs)"


# --------------------------------------------------------------------------------------------- verify
def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    base = unwrap_model(trainer.model)
    have = getattr(getattr(base, "config", None), "_attn_implementation", None)
    if not decision.active:
        return False, f"{decision.reason}; config._attn_implementation={have}"
    want = outcome.facts.get("fell_back_to") or decision.settings.implementation
    text = f"config._attn_implementation={have}"
    if have != want:
        refused = [f for f in outcome.fallbacks if f.startswith(f"{want}: transformers refused")]
        return False, f"{text}; {refused[0]}" if refused else f"{text} - MISMATCH: planned {want}"
    if want == sdpa_varlen.NAME:
        from transformers import AttentionInterface

        registered = AttentionInterface._global_mapping.get(want) is sdpa_varlen.attention_forward
        text += "; hf_speedup::sdpa_varlen registered with AttentionInterface" if registered else \
            "; sdpa_varlen NOT registered with AttentionInterface"
        return registered, text
    if want == blocked.NAME:
        from transformers import AttentionInterface

        from ..probe import steps_trained

        if AttentionInterface._global_mapping.get(want) is not blocked.attention_forward:
            return False, text + "; blocked NOT registered with AttentionInterface"
        calls = blocked.CALLS[0] - outcome.facts.get("calls_before", 0)
        tiled = blocked.TILED[0] - outcome.facts.get("tiled_before", 0)
        text += (f"; hf_speedup::blocked_attention registered ({outcome.facts.get('build', 'loaded')}); "
                 f"{calls} kernel call(s)" + (f", {tiled} of them tiled" if calls else "") +
                 (" ({} queries x {} keys)".format(*blocked.tiles()) if tiled else ""))
        if steps_trained(trainer, outcome) > 0 and calls == 0:  # every call went to sdpa's fallback path
            return False, text + " in training: it never ran (each call fell back to sdpa)"
        return True, text
    return True, text
