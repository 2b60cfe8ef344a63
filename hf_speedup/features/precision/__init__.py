"""bf16 / fp16 (+ grad scaling) / fp32 through TrainingArguments; TF32 and cudnn.benchmark on CUDA.

Fallback chain: bf16 -> fp16 with dynamic loss scaling (CUDA without bf16) -> fp32; with
``precision.strict`` a request that cannot run here is a :class:`SpeedupConfigError` at plan time.
``auto`` picks bf16 where it is native *and fast* (``caps.bf16``: Ampere+ GPU, AMX CPU) and, on any other CPU,
where bf16 autocast ran this model's matmuls at least ``matmul_speed.THRESHOLD`` (1.25x) as fast as fp32 when
timed on this machine at the model's shapes (``caps.measured["precision.bf16_matmul"]``, by the ``measure`` hook
in :mod:`.matmul_speed`): on a CPU with avx512_bf16 but no AMX that depends on the shapes (2-3x at a 135M model's,
slower at a toy model's). Not measured (``HF_SPEEDUP_MEASURE=0``, no model): fp32 there, as the flags say.

An explicit choice wins over ``auto`` and the reason names it: TrainingArguments' ``bf16``/``fp16`` flags,
else the launcher's ``ACCELERATE_MIXED_PRECISION`` (``accelerate launch --mixed_precision no|bf16|fp16``, or
its config file, exports it; TrainingArguments itself reads it when neither flag is set). An explicit
``precision.dtype`` in the config overrides both, and says so.

Engagement rule: ``engaged`` is True iff every reduced-precision setting the decision stands for
(bf16 or fp16 autocast, TF32 matmuls) is verified in force on the live objects. A decision for plain
fp32 accelerates nothing: it is reported ``engaged: false`` with "fp32 (no mixed precision) in force as
planned" — or with what differs from the plan.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from ...compat import set_tf32, tf32_matmul_state
from ...config import SpeedupConfigError
from ...dtypes import short_name, to_dtype
from ...plan_types import Decision, Outcome, PlanContext
from ..deepspeed import adapted, engine
from ..explicit_args import users_choice
from ..fallback import walk_chain
from .matmul_speed import KEY as MEASURED_KEY
from .matmul_speed import THRESHOLD, measure  # noqa: F401  (measure: the feature's hook, run at the door)

NAME = "precision"
CHAIN = ("bf16", "fp16", "fp32")
logger = logging.getLogger("hf_speedup")


@dataclass(frozen=True)
class Settings:
    dtype: torch.dtype  # the compute dtype: bf16/fp16 autocast, or fp32 (no mixed precision)
    keep: bool  # the TrainingArguments' own flags stay as they are (baseline)
    tf32: bool | None  # TF32 matmuls to set, or None to leave alone
    tf32_requested: Any
    cudnn_benchmark: bool
    device_type: str

    @property
    def name(self) -> str:
        """``'bf16'`` | ``'fp16'`` | ``'fp32'``."""
        return short_name(self.dtype)

    @property
    def grad_scaling(self) -> bool:
        return self.dtype == torch.float16


# --------------------------------------------------------------------------------------------- decide
LAUNCHER_ENV = "ACCELERATE_MIXED_PRECISION"  # what ``accelerate launch --mixed_precision X`` (or its config) sets
_LAUNCHER_DTYPES = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}
_LAUNCHER_NAMES = {v: k for k, v in _LAUNCHER_DTYPES.items()}


def args_dtype(args) -> str:
    """The dtype a TrainingArguments asks for ('fp32' when neither flag is set or there are no args)."""
    if args is not None and getattr(args, "bf16", False):
        return "bf16"
    if args is not None and getattr(args, "fp16", False):
        return "fp16"
    return "fp32"


def launcher_dtype(environ=None) -> str | None:
    """The launcher's mixed precision (``accelerate launch`` exports it for every process), None when unset."""
    import os

    value = (os.environ if environ is None else environ).get(LAUNCHER_ENV)
    return _LAUNCHER_DTYPES.get(value.strip().lower()) if value else None


def explicit_dtype(args) -> tuple[str | None, str]:
    """(dtype, who chose it) of an explicit user or launcher choice, (None, "") where nobody chose.

    The order is TrainingArguments' own: its ``bf16``/``fp16`` flags win over the launcher's variable,
    which it reads when neither flag is set.
    """
    user = args_dtype(args)
    if user != "fp32":
        return user, f"the TrainingArguments' explicit {user}=True"
    off = [flag for flag in ("bf16", "fp16") if users_choice(args, flag) == (True, False)]
    if off:  # recorded by training_arguments(): a default-valued False that is the user's own
        return "fp32", f"the TrainingArguments' explicit {'/'.join(off)}=False"
    launcher = launcher_dtype()
    if launcher is not None:
        import os

        return launcher, f"the launcher's mixed_precision={os.environ[LAUNCHER_ENV]} ({LAUNCHER_ENV})"
    return None, ""


def runnable(dtype: str, caps) -> tuple[bool, str]:
    """Can ``dtype`` mixed precision run here at all? (Fast is a separate question: ``caps.bf16``.)"""
    if dtype == "fp32":
        return True, ""
    if dtype == "bf16":
        if caps.bf16 or caps.device_type == "cpu":  # CPU autocast runs bf16 everywhere, slowly without AMX
            return True, ""
        return False, f"no bf16 on {caps.device_name} ({caps.bf16_reason or 'needs an Ampere+ GPU'})"
    if caps.device_type == "cpu":
        return False, "fp16 autocast is not available on CPU (accelerate runs fp16 only on accelerators)"
    if not caps.fp16:
        return False, f"no fp16 on {caps.device_name}"
    return True, ""


def _strict_error(field: str, value, why: str, allowed: list, fix: str) -> SpeedupConfigError:
    return SpeedupConfigError([
        f"{field} = {value!r} cannot run on this machine ({why}) and precision.strict = true; "
        f"allowed here: {', '.join(repr(a) for a in allowed)}; fix: {fix}"
    ])


def _walk_chain(wanted: str, caps, strict: bool, from_args: bool = False,
                from_launcher: bool = False) -> tuple[str, list[str]]:
    """First runnable dtype from ``wanted`` down the chain; each skipped step becomes a fallback."""

    def strict_error(dtype: str, why: str) -> SpeedupConfigError:
        allowed = [d for d in CHAIN if runnable(d, caps)[0]] + ["auto"]
        if from_launcher:  # auto keeps the launcher's choice, so that is what cannot run
            import os

            runs = [_LAUNCHER_NAMES[d] for d in CHAIN if runnable(d, caps)[0]]
            return _strict_error(LAUNCHER_ENV, os.environ.get(LAUNCHER_ENV), why, allowed,
                                 f"launch with --mixed_precision {' or '.join(runs)}, or precision.strict: false")
        if from_args:  # auto keeps the TrainingArguments' flag, so that flag is what cannot run
            return _strict_error(f"TrainingArguments.{dtype}", True, why, allowed,
                                 f"set {dtype}=False in TrainingArguments (precision.dtype: auto then picks "
                                 "for this machine), or precision.strict: false")
        return _strict_error("precision.dtype", dtype, why, allowed,
                             "set precision.dtype: auto (or one of the allowed values), or precision.strict: "
                             "false to fall back along bf16 -> fp16 -> fp32")

    return walk_chain(CHAIN[CHAIN.index(wanted):], lambda d: runnable(d, caps), strict_error if strict else None)


def _measured_bf16(caps):
    """The bf16/fp32 matmul speed this CPU measured at the model's shapes (a Measurement), None where not measured
    or where the timing was implausible (a busy machine)."""
    m = caps.measured.get(MEASURED_KEY) if caps.device_type == "cpu" else None
    return m if m is not None and m.value is not None else None


def _bf16_fast(caps) -> bool:
    """bf16 is faster here: native (``caps.bf16``), or measured at least THRESHOLD x fp32 on this CPU."""
    m = _measured_bf16(caps)
    return bool(caps.bf16 or (m is not None and m.value >= THRESHOLD))


def _measured_text(m) -> str:
    return f"matmuls at this model's shapes measured {m.value:.2f}x fp32 ({m.text()})"


def _auto_dtype(caps) -> tuple[str, str]:
    if caps.bf16:
        return "bf16", f"bf16 autocast: native and fast here ({caps.bf16_reason or caps.device_name})"
    if caps.device_type == "cuda" and caps.fp16:
        return "fp16", (f"fp16 autocast with dynamic loss scaling: {caps.device_name} has fp16 tensor cores "
                        f"but no bf16 ({caps.bf16_reason or 'compute capability < 8.0'})")
    if (m := _measured_bf16(caps)) is not None:
        if m.value >= THRESHOLD:
            return "bf16", (f"bf16 autocast: {_measured_text(m)}, at least the {THRESHOLD}x it takes to speed up "
                            "a whole step")
        return "fp32", (f"fp32 (no mixed precision): bf16 autocast {_measured_text(m)}, under the {THRESHOLD}x it "
                        "takes to speed up a whole step")
    reason = f"fp32 (no mixed precision): bf16 would not be faster here ({caps.bf16_reason or 'no native bf16'})"
    if caps.device_type == "cpu" and (noisy := caps.measured.get(MEASURED_KEY)) is not None:
        reason += f"; bf16 speed at this model's shapes could not be measured: {noisy.text()}"
    elif caps.device_type == "cpu":
        from ...measured import MEASURE_ENV, measuring_enabled

        why = "no model to time at" if measuring_enabled() else f"{MEASURE_ENV}=0"
        reason += f"; bf16 speed at this model's shapes not measured ({why})"
    return "fp32", reason


def _decide_dtype(s, caps, args) -> tuple[str, str, list[str]]:
    """(dtype, reason, fallbacks) for ``precision.dtype``. An explicit user or launcher choice wins over ``auto``."""
    chosen, who = explicit_dtype(args)
    if s.dtype == "keep":
        return chosen or "fp32", (f"keep: {who}" if who else "keep: TrainingArguments' own setting (fp32)"), []
    if s.dtype == "auto":
        if chosen is not None:
            dtype, fallbacks = (chosen, []) if chosen == "fp32" else _walk_chain(
                chosen, caps, s.strict, from_args=True, from_launcher=who.startswith("the launcher"))
            reason = f"auto keeps {who}"
            own, _ = _auto_dtype(caps)
            if dtype != chosen:
                reason += f", which cannot run here -> {dtype}"
            elif chosen == "fp16" and _bf16_fast(caps):
                reason += " (bf16 would be preferable on this device: no loss scaling, same speed)"
            elif own != dtype:
                reason += f" over auto's own choice here ({own})"
            return dtype, _slow_bf16_note(dtype, caps, reason), fallbacks
        dtype, reason = _auto_dtype(caps)
        return dtype, reason, []
    dtype, fallbacks = _walk_chain(s.dtype, caps, s.strict)
    reason = f"{dtype} as requested" if dtype == s.dtype else f"{s.dtype} cannot run here -> {dtype}"
    if dtype == "fp16":
        reason += " (autocast with dynamic loss scaling)"
    if chosen is not None and chosen != s.dtype:
        source = f"TrainingArguments' {chosen}" if who.startswith("the TrainingArguments") else who
        reason += f"; overrides {source} (precision.dtype is explicit)"
        if dtype == "fp32" and who.startswith("the launcher"):
            reason += (f"; note: TrainingArguments cannot turn the launcher's {chosen} off: launch with "
                       "--mixed_precision no for an fp32 run")
    return dtype, _slow_bf16_note(dtype, caps, reason), fallbacks


def _slow_bf16_note(dtype: str, caps, reason: str) -> str:
    if dtype != "bf16" or _bf16_fast(caps):
        return reason
    if (m := _measured_bf16(caps)) is not None:
        return reason + f"; expected no faster than fp32 here: bf16 autocast {_measured_text(m)}"
    return reason + f"; expected SLOWER than fp32 here: {caps.bf16_reason or 'no native bf16'}"


def _decide_tf32(s, caps, args) -> tuple[bool | None, str, list[str]]:
    """(tf32 value to set or None to leave alone, reason, fallbacks)."""
    want = s.tf32
    if want == "keep":
        return None, "tf32: keep", []
    if caps.device_type != "cuda":
        note = f"tf32: n/a on {caps.device_type} (CUDA Ampere+ only)"
        if want is True:
            if s.strict:
                raise _strict_error("precision.tf32", True, note, ["auto", "keep", False],
                                    "set precision.tf32: auto, or precision.strict: false")
            return None, note, [note]
        return None, note, []
    if want is False:
        return False, "tf32 off as requested", []
    if not caps.tf32:
        note = (f"tf32: {caps.device_name} is an AMD GPU (ROCm), where transformers allows no TF32" if caps.rocm
                else f"tf32: {caps.device_name} has no TF32 (needs compute capability >= 8.0)")
        if want is True and s.strict:
            raise _strict_error("precision.tf32", True, note, ["auto", "keep", False],
                                "set precision.tf32: auto, or precision.strict: false")
        return None, note, [note] if want is True else []
    if want == "auto" and args is not None and getattr(args, "tf32", None) is False:
        return False, "tf32: auto keeps the TrainingArguments' explicit tf32=False", []
    return True, "tf32 on for fp32 matmuls", []


def decide(ctx: PlanContext) -> Decision:
    s, caps, args = ctx.config.precision, ctx.caps, ctx.args
    dtype, reason, fallbacks = _decide_dtype(s, caps, args)
    if (enabled := engine(ctx).precision) and s.dtype != "keep" and dtype != enabled:
        why = adapted(ctx, "precision.dtype", s.dtype, f"the DeepSpeed config enables {enabled} explicitly (its "
                      "bf16/fp16 block), and transformers refuses TrainingArguments that disagree with it",
                      f"precision.dtype: {enabled}, or 'auto' in the config's {enabled}.enabled")
        dtype, reason, fallbacks = enabled, f"{why} -> {enabled}", [*fallbacks, why]
    tf32, tf32_reason, tf32_fallbacks = _decide_tf32(s, caps, args)
    cudnn_benchmark = caps.device_type == "cuda" and s.tf32 != "keep"
    notes = [reason, tf32_reason] + (["cudnn.benchmark on"] if cudnn_benchmark else [])
    weights = ctx.model.dtype if ctx.model is not None else None
    if weights == "float16" and dtype == "fp16" and not ctx.config.lora.enabled:
        notes.append("note: float16 weights cannot be fully fine-tuned under grad scaling ('Attempting to unscale "
                     "FP16 gradients'); load the model in float32 or bfloat16")
    elif weights == "bfloat16" and dtype == "fp32":
        notes.append("note: the weights are bfloat16, so compute runs in bf16 without autocast")
    decision = Decision(
        NAME, requested=s.dtype, applied=dtype + ("+tf32" if tf32 else ""), reason="; ".join(notes),
        settings=Settings(dtype=to_dtype(dtype), keep=s.dtype == "keep", tf32=tf32, tf32_requested=s.tf32,
                          cudnn_benchmark=cudnn_benchmark, device_type=caps.device_type),
        fallbacks=tuple(fallbacks + tf32_fallbacks),
    )
    for fb in decision.fallbacks:
        logger.warning("hf_speedup precision fallback: %s", fb)
    if dtype == "bf16" and not _bf16_fast(caps):
        logger.warning("hf_speedup precision: %s", reason)
    return decision


# --------------------------------------------------------------------------------------------- apply
def training_args(decision: Decision, args) -> dict:
    """bf16/fp16/tf32 overrides; nothing for ``keep`` (the baseline must leave the args untouched)."""
    st = decision.settings
    out: dict = {}
    if not st.keep:
        out.update(bf16=st.name == "bf16", fp16=st.name == "fp16")
        # TrainingArguments refuses bf16 without a bf16 GPU unless told the run is on CPU
        if st.name == "bf16" and st.device_type == "cpu" and not getattr(args, "use_cpu", False):
            out["use_cpu"] = True
    if st.tf32 is not None:
        out["tf32"] = st.tf32
    return out


def apply(decision: Decision, setup, outcome: Outcome) -> None:
    """cudnn.benchmark is process-global torch state, not a TrainingArguments field: set it here. TF32 too is
    set here, through :func:`~hf_speedup.compat.set_tf32`: transformers' ``enable_tf32`` is cached per value
    (in a process that already ran with another value the TrainingArguments alone would leave the last run's
    setting), and sets torch's new API alone, which leaves ``torch.get_float32_matmul_precision()`` raising
    for inductor."""
    if decision.settings.tf32 is not None:
        set_tf32(decision.settings.tf32)
    if decision.settings.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
        logger.info("hf_speedup precision: torch.backends.cudnn.benchmark = True")


# --------------------------------------------------------------------------------------------- verify
def _trainable_dtypes(model) -> Counter:
    return Counter(short_name(p.dtype) for p in model.parameters() if p.requires_grad)


def _dtype_in_force(trainer) -> tuple[str, str]:
    """(dtype actually in force: bf16|fp16|fp32, evidence) from the trainer's accelerator and model."""
    acc = getattr(trainer, "accelerator", None)
    mp = str(getattr(acc, "mixed_precision", "no"))
    native = bool(getattr(acc, "native_amp", False))
    scaler = getattr(acc, "scaler", None)
    prepared = bool(getattr(acc, "_models", None))
    wrapped = hasattr(trainer.model, "_original_forward")
    evidence = f"accelerator.mixed_precision={mp!r}, native_amp={native}"
    if mp == "fp16":
        evidence += f", grad scaler={'yes' if scaler is not None else 'none'}"
    if prepared:
        evidence += f", autocast forward={'yes' if wrapped else 'no'}"
    if mp in ("bf16", "fp16") and native and (wrapped or not prepared) and (mp == "bf16" or scaler is not None):
        return mp, evidence
    if mp in ("bf16", "fp16"):
        return "fp32", evidence + f" -> {mp} is NOT active (no autocast{'/grad scaler' if mp == 'fp16' else ''})"
    return "fp32", evidence


def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    st = decision.settings
    want = st.name
    have, evidence = _dtype_in_force(trainer)
    parts, ok = [], True
    dtypes = _trainable_dtypes(trainer.model)
    weights = ", ".join(f"{k}: {v}" for k, v in dtypes.most_common()) or "none trainable"
    if have != want:
        ok = False
        parts.append(f"MISMATCH: planned {want}, in force {have} ({evidence})")
        logger.warning("hf_speedup precision: planned %s but %s is in force (%s)", want, have, evidence)
    elif want == "fp32":
        parts.append(f"fp32 (no mixed precision) in force as planned ({evidence})")
    else:
        parts.append(f"{want} autocast in force ({evidence})")
    parts.append(f"trainable weights {weights}")
    accelerated = want != "fp32"
    if st.tf32 is not None:
        on, how = tf32_matmul_state()  # as inductor reads it: a state its GEMM autotuning cannot read is not on
        parts.append(f"TF32 matmuls {'on' if on else 'off'} ({how})")
        if on != st.tf32:
            ok = False
            parts.append(f"MISMATCH: planned tf32={st.tf32}")
        accelerated = accelerated or bool(st.tf32)
    if st.cudnn_benchmark:
        bench = bool(torch.backends.cudnn.benchmark)
        parts.append(f"cudnn.benchmark={bench}")
        ok = ok and bench
    return bool(ok and accelerated), "; ".join(parts)
