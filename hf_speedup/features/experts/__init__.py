"""How a mixture of experts runs its routed experts: ``config._experts_implementation`` chosen by timing at the
model's shapes, set through transformers' own switch (``set_experts_implementation``), read back from the live
experts modules.

transformers' implementations (:mod:`.kernels`): ``eager`` (the per-expert loop), ``batched_mm`` and
``grouped_mm``; transformers gives every model ``grouped_mm`` unless asked otherwise. Which is fastest depends on
the device as much as on the shapes: on a Zen 4 CPU the loop beat grouped_mm about 6x and batched_mm about 10x
at a Qwen3-MoE-like shape, while on CUDA grouped GEMMs win. So ``auto`` takes the fastest of what the door timed
(:mod:`.timing`: one MoE layer forward+backward per implementation, ``caps.measured["experts.kernel"]``), never
one slower than the loop; where nothing was measured (``HF_SPEEDUP_MEASURE=0``) the known-good default per device
(CPU: the loop; CUDA: grouped_mm where torch has the kernel), and the reason says it was not measured.

An implementation asked for by name wins; one the model already runs that is not transformers' default was set by
its user (``from_pretrained(..., experts_implementation=...)``) and ``auto`` keeps it; ``keep`` (the baseline)
leaves the model alone. A choice that cannot run here falls back to ``auto``'s, listed in ``fallbacks``; with
``experts.strict`` it is an error instead. A dense model: not applicable. Models whose experts do not dispatch
through transformers' ``ExpertsInterface`` (DBRX, JetMoE, Llama 4) run their own code: off, with the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ...blocks import unwrap_model
from ...config import SpeedupConfigError
from ...model_parts import experts_modules
from ...plan_types import OFF, Decision, Outcome, PlanContext
from . import kernels
from .kernels import KERNELS, TRANSFORMERS_DEFAULT, WHY, usable

NAME = "experts"
APPLIES_TO = "model"
MEASURED = "experts.kernel"  # caps.measured key: {implementation: seconds (or why not timed)}
MARGIN = 0.05  # a kernel replaces the loop only when it is measured at least 5% faster (timing noise)
logger = logging.getLogger("hf_speedup")


@dataclass(frozen=True)
class Settings:
    implementation: str | None = None  # set on the model; None keeps it
    previous: str | None = None  # the model's own when the plan was made
    timings: tuple[tuple[str, float | str], ...] = ()  # what the door measured, (implementation, seconds | why not)
    measured: bool = False  # auto chose from a measurement (not the per-device default)
    strict: bool = False


def _off(requested, reason: str, settings: Settings, fallbacks=()) -> Decision:
    return Decision(NAME, requested=requested, applied=OFF, reason=reason, settings=settings,
                    fallbacks=tuple(fallbacks))


def _timings(caps) -> tuple[tuple[str, float | str], ...]:
    m = caps.measured.get(MEASURED)
    value = getattr(m, "value", None)
    if not isinstance(value, dict):
        return ()
    return tuple((k, v if isinstance(v, str) else float(v)) for k, v in value.items()
                 if isinstance(v, (int, float, str)) and not isinstance(v, bool))


def timings_text(timings) -> str:
    return ", ".join(f"{k} {v * 1e3:.1f} ms" if isinstance(v, float) else f"{k} {v}" for k, v in timings)


def _auto(caps, here: list[str]) -> tuple[str, str, bool]:
    """(choice, reason, measured) of ``auto`` among the implementations that can run here."""
    table = dict(_timings(caps))
    timed = {k: v for k, v in table.items() if isinstance(v, float) and k in here}
    if "eager" in timed:
        m = caps.measured[MEASURED]
        fastest = min(timed, key=timed.get)
        text = f"measured {timings_text(table.items())} ({m.text()})"
        if fastest != "eager" and timed[fastest] > timed["eager"] * (1 - MARGIN):
            return "eager", (f"eager: {fastest} was within {MARGIN:.0%} of the loop, which is kept; {text}"), True
        if fastest == "eager":
            return "eager", f"eager: the loop measured fastest; {text}", True
        return fastest, (f"{fastest}: {timed['eager'] / timed[fastest]:.1f}x the loop's speed; {text}"), True
    choice = kernels.default(caps)
    where = "CUDA" if caps.is_cuda else caps.device_type
    return choice, (f"{choice}: not measured (HF_SPEEDUP_MEASURE=0 or no timing at the door), the known-good default "
                    f"on {where} ({WHY[choice]})"), False


def decide(ctx: PlanContext) -> Decision:
    cfg, caps, info = ctx.config.experts, ctx.caps, ctx.model
    asked = cfg.implementation
    current = getattr(info, "experts_implementation", None)
    settings = Settings(previous=current, timings=_timings(caps), strict=bool(cfg.strict))
    if info is None:
        return _off(asked, "no model yet: the experts implementation is chosen when the trainer gets the model", settings)
    if not (info.expert_parameters or info.routers or info.experts_modules):
        return _off(asked, f"not applicable: {info.architecture} has no routed experts", settings)
    if asked == "keep":
        return _off(asked, f"keep: the model's own experts implementation ({current or 'its own code'})", settings)
    here = [k for k in KERNELS if usable(k, caps)[0]]
    if not info.experts_modules:
        why = (f"{info.architecture} runs its own expert code (no @use_experts_implementation dispatch), which "
               "transformers cannot switch")
        if asked != "auto" and cfg.strict:
            raise SpeedupConfigError([
                f"experts.implementation = {asked!r} cannot apply: {why}, and experts.strict = true; allowed for this "
                "model: 'auto', 'keep'; fix: set experts.implementation: auto, or experts.strict: false"])
        return _off(asked, why, settings, [f"experts: {why}"] if asked != "auto" else [])
    fallbacks: list[str] = []
    if asked != "auto":
        ok, why = usable(asked, caps)
        if ok:
            reason = f"{asked}: asked for ({WHY[asked]})"
            if settings.timings:
                reason += f"; measured {timings_text(settings.timings)}"
            return _on(asked, asked, reason, settings, current)
        if cfg.strict:
            raise SpeedupConfigError([
                f"experts.implementation = {asked!r} cannot run here ({why}) and experts.strict = true; allowed here: "
                f"{', '.join(repr(k) for k in here)}, 'auto', 'keep'; fix: set experts.implementation: auto, or "
                "experts.strict: false to fall back"])
        fallbacks.append(f"{asked} -> {{chosen}}: {why}")
    elif current not in (None, TRANSFORMERS_DEFAULT) and current in KERNELS:
        return _on(asked, current, (f"auto: kept {current}, set on the model by its user (transformers' own default is "
                             f"{TRANSFORMERS_DEFAULT}); set experts.implementation to replace it"), settings, current)
    chosen, reason, measured = _auto(caps, here)
    fallbacks = [f.format(chosen=chosen) for f in fallbacks]
    for fb in fallbacks:
        logger.warning("hf_speedup experts fallback: %s", fb)
    return _on(asked, chosen, reason, Settings(previous=current, timings=settings.timings, measured=measured,
                                        strict=settings.strict), current, fallbacks)


def _on(asked, chosen: str, reason: str, settings: Settings, current, fallbacks=()) -> Decision:
    if current == chosen:
        reason += " - already the model's"
    elif current:
        reason += f" (the model had {current})"
    return Decision(NAME, requested=asked, applied=chosen, reason=reason, fallbacks=tuple(fallbacks),
                    settings=Settings(implementation=chosen, previous=current, timings=settings.timings,
                                      measured=settings.measured, strict=settings.strict))


def training_args(decision: Decision, args) -> dict:
    return {}


def changes_model(decision: Decision, plan) -> bool:
    return decision.active and decision.settings.implementation != decision.settings.previous


# --------------------------------------------------------------------------------------------- measure
def measure(config, caps, info) -> dict:
    """The door's timing for ``auto`` (see :mod:`.timing`); nothing where auto would not read it."""
    from .door import measure as run

    return run(config, caps, info)


# --------------------------------------------------------------------------------------------- apply
def apply(decision: Decision, setup, outcome: Outcome) -> None:
    """Set the implementation on the model through transformers' switch (every sub-model follows)."""
    if not decision.active or setup.model is None or isinstance(setup.model, str):
        return
    name = decision.settings.implementation
    base = unwrap_model(setup.model)
    found = experts_modules(base)
    if all(m.config._experts_implementation == name for _, m in found):
        return
    try:
        if hasattr(base, "set_experts_implementation"):
            base.set_experts_implementation(name)
        for _, m in found:  # an experts module whose config is not a (sub-)model's own
            if m.config._experts_implementation != name:
                m.config._experts_implementation = name
    except (ImportError, ValueError, RuntimeError, KeyError) as exc:
        why = str(exc).splitlines()[0] if str(exc) else repr(exc)
        current = found[0][1].config._experts_implementation if found else None
        if decision.settings.strict:
            raise SpeedupConfigError([
                f"experts.implementation = {name!r}: transformers refused it on this model ({why}) and "
                f"experts.strict = true; allowed: {', '.join(repr(k) for k in KERNELS)}, 'auto', 'keep'; fix: set "
                "experts.implementation: keep, or experts.strict: false to fall back"]) from exc
        note = f"{name}: transformers refused it on this model ({why}); the model keeps {current}"
        outcome.fallbacks.append(note)
        outcome.applied = str(current)
        logger.warning("hf_speedup experts fallback: %s", note)


# --------------------------------------------------------------------------------------------- verify
def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    base = unwrap_model(trainer.model)
    found = experts_modules(base)
    have = sorted({str(m.config._experts_implementation) for _, m in found})
    text = f"{len(found)} experts module(s), config._experts_implementation={'/'.join(have) or None}"
    if not decision.active:
        return False, f"{decision.reason}; {text}" if found else decision.reason
    want = decision.settings.implementation
    if have != [want]:
        refused = [f for f in outcome.fallbacks if f.startswith(f"{want}: transformers refused")]
        return False, f"{text}; {refused[0]}" if refused else f"{text} - MISMATCH: planned {want}"
    name, module = found[0]
    if sharded := kernels.sharded(module):  # a forward alone would gather across ranks: read the config only
        outcome.facts["dispatch"] = f"not probed ({sharded})"
        return True, f"{text}; {name}'s weights are {sharded}: read from the config, no probe forward"
    try:
        key, function = kernels.dispatched(module)
    except Exception as exc:  # sharded (FSDP, ZeRO-3) or otherwise not callable alone: the config is what it reads
        why = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        outcome.facts["dispatch"] = f"not probed ({why})"
        return True, f"{text}; a probe forward of {name} could not run alone ({why}), read from the config only"
    outcome.facts["dispatch"] = f"{name}: {key} -> {function}"
    if key != want:
        return False, f"{text}; a 4-token forward of {name} dispatched {key!r} ({function}) - MISMATCH: planned {want}"
    return True, f"{text}; a 4-token forward of {name} ran {function}"
