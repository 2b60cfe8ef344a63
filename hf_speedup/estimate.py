"""estimate_memory: how much memory one training step needs, before loading a single weight.

The model is described on the meta device (from a model, a config object, a local config path, a ``.gguf``
file or a hub id whose config is cached), the plan is made as ``SpeedupTrainer`` would make it on this
machine (or on ``caps``), and :mod:`hf_speedup.memory_model` turns both into the step's peak, broken down.
The formulas and their sources are in that module's docstring; ``benchmarks/RESULTS.md`` compares them with
torch's ``MemTracker``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

from .compat import accelerate_state_kept, replace_args
from .config import SpeedupConfig, SpeedupConfigError, parse_size
from .features.deepspeed import zero_note
from .features.memory.budget import training_setup
from .hardware import Capabilities, probe
from .loading import load_kwargs
from .memory_model import MemoryEstimate, estimate, fmt_bytes
from .model_info import ModelInfo, describe_model
from .plan import build_plan, measure
from .presets import resolve

__all__ = ["estimate_memory", "estimate_described", "describe_for_estimate", "cheapest_fit", "fits_text",
           "longest_sequence", "longest_described", "LongestSequence", "per_token"]


def _config_from(source: Any, trust_remote_code: bool = False):
    """A transformers config from a config object, a dict, a local path (dir, config.json, .gguf) or a hub id."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, PretrainedConfig):
        return source
    if isinstance(source, dict):
        data = dict(source)
        model_type = data.pop("model_type", None)
        if not model_type:
            raise SpeedupConfigError([f"model config {source!r} has no 'model_type'; allowed: a transformers config "
                                      "dict with model_type (e.g. 'llama'); fix: add \"model_type\": \"llama\""])
        return AutoConfig.for_model(model_type, **data)
    path = Path(os.fspath(source))
    if path.is_file() and path.suffix == ".gguf":
        return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if path.is_file():
        return _config_from(json.loads(path.read_text()))
    if path.is_dir():
        return AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    try:
        return AutoConfig.from_pretrained(str(source), local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise SpeedupConfigError([
            f"model = {str(source)!r} is neither a local path nor a hub id with a cached config "
            f"({exc.__class__.__name__}); "
            "allowed: a model, a transformers config, a directory or config.json, a .gguf file, or a hub id whose "
            "config.json is in the local cache; fix: download it once (huggingface-cli download ID config.json) or "
            "pass a local path"
        ]) from None


def describe_for_estimate(model_or_config: Any, trust_remote_code: bool = False) -> tuple[ModelInfo, bool]:
    """(ModelInfo, whether it came from real weights). Configs are built on the meta device: no memory, seconds."""
    if isinstance(model_or_config, torch.nn.Module):
        return describe_model(model_or_config), True
    config = _config_from(model_or_config, trust_remote_code)
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return describe_model(model), False


def _arguments(batch_size: int, grad_accum: int, caps: Capabilities, args: Any = None):
    """The TrainingArguments the plan reads (the user's, with this batch shape). Building them resets accelerate's
    process-wide state: call it inside ``accelerate_state_kept``."""
    if args is not None:
        return replace_args(args, {"per_device_train_batch_size": batch_size,
                                   "gradient_accumulation_steps": grad_accum})
    from transformers import TrainingArguments

    return TrainingArguments(output_dir="hf_speedup_estimate", per_device_train_batch_size=batch_size,
                             gradient_accumulation_steps=grad_accum, report_to=[], use_cpu=caps.device_type == "cpu")


def estimate_memory(model_or_config: Any, *, speedup: Any = "auto", batch_size: int, seq_len: int,
                    world_size: int = 1, gradient_accumulation_steps: int = 1, caps: Capabilities | None = None,
                    padded: bool = False, args: Any = None, trust_remote_code: bool = False) -> MemoryEstimate:
    """The peak memory of one steady-state training step (``total_bytes``, ``breakdown`` of what is alive then).

    ``model_or_config``: an ``nn.Module``, a transformers config (object or dict), a local directory /
    config.json / ``.gguf`` file, or a hub id whose config is cached. ``speedup`` as ``SpeedupTrainer`` takes
    it: the estimate follows the plan it makes on this machine (``caps`` to plan for another one), including
    what ``memory.budget`` changes. ``padded``: batches carry a padding mask (no packing). ``args``: your
    TrainingArguments (their optimizer, precision flags, ...; the batch shape given here wins). Weights built
    from a config have the dtype ``load_model`` would load them in (fp32 to fine-tune, the compute dtype under
    LoRA); a model's own weights count as they are.
    """
    if not all(isinstance(v, int) and v >= 1 for v in (batch_size, seq_len, world_size, gradient_accumulation_steps)):
        raise SpeedupConfigError([f"batch_size = {batch_size!r}, seq_len = {seq_len!r}, world_size = {world_size!r}, "
                                  f"gradient_accumulation_steps = {gradient_accumulation_steps!r}: allowed: integers "
                                  ">= 1; fix: e.g. batch_size=8, seq_len=2048, world_size=1"])
    cfg = resolve(speedup)  # a bad config fails before any model is built
    described = describe_for_estimate(model_or_config, trust_remote_code)
    caps = measure(cfg, caps if caps is not None else probe(args), described[0])  # e.g. bf16 by measured speed
    return estimate_described(described, cfg, batch_size=batch_size, seq_len=seq_len, world_size=world_size,
                              gradient_accumulation_steps=gradient_accumulation_steps, caps=caps, padded=padded,
                              args=args)


def estimate_described(described: tuple[ModelInfo, bool], cfg: SpeedupConfig, *, batch_size: int, seq_len: int,
                       caps: Capabilities, world_size: int = 1, gradient_accumulation_steps: int = 1,
                       padded: bool = False, args: Any = None, gpus_per_node: int | None = None) -> MemoryEstimate:
    """:func:`estimate_memory` for a model already described (``describe_for_estimate``), a resolved config and the
    machine's capabilities (each door resolves and probes once). ``gpus_per_node``: the shard group of
    ``fsdp.strategy: hybrid_shard`` where this process plans no sharding (default: every rank)."""
    info, real = described
    if cfg.memory.budget is not None and cfg.memory.seq_len is None:
        cfg = cfg.replace(memory={"seq_len": seq_len})
    if world_size != caps.world_size:
        caps = dataclasses.replace(caps, world_size=world_size)
    if info.shape is None:
        raise SpeedupConfigError([f"model {info.architecture}: no repeated decoder block or no hidden size found; "
                                  "allowed: decoder-only transformers models (Llama, Mistral, Qwen, SmolLM, ...); "
                                  "fix: pass a causal LM or its config"])
    if not real and cfg.lora.enabled and cfg.lora.quantization and caps.bitsandbytes:
        info = dataclasses.replace(info, quantization=cfg.lora.quantization)  # load_model quantizes it at load
    with accelerate_state_kept():  # the arguments built here must not reset a live Trainer's accelerate state
        arguments = _arguments(batch_size, gradient_accumulation_steps, caps, args)
        plan = build_plan(cfg, caps, info, arguments)
        if not real and (loaded := load_kwargs("config", plan)[1]["dtype"].itemsize) != info.shape.weight_bytes:
            # weights from a config load in the plan's dtype (a LoRA base in bf16 where precision chose bf16, by the
            # CPU's flag or by measurement): memory.budget sizes the model so loaded, as this estimate does
            info = dataclasses.replace(info, shape=dataclasses.replace(info.shape, weight_bytes=loaded))
            plan = build_plan(cfg, caps, info, arguments)
    fit = getattr(plan["memory"].settings, "budget", None)
    micro, accum = batch_size, gradient_accumulation_steps
    changes: list[str] = []
    if fit is not None and fit.changed:
        if fit.micro_batch is not None:
            micro, accum = fit.micro_batch, fit.grad_accum
            changes.append(f"micro-batch {batch_size} x {gradient_accumulation_steps} accumulation -> "
                           f"{micro} x {accum}")
        changes += [f"{k}: {v!r}" for k, v in fit.changes]
    # weights from a config: the dtype load_model would load them in
    weight_bytes = None if real else load_kwargs("config", plan)[1]["dtype"].itemsize
    setup = training_setup(plan.decisions, info.shape, caps, micro_batch=micro, seq_len=seq_len, grad_accum=accum,
                           weight_bytes=weight_bytes, padded=padded)
    notes = []
    if cfg.fsdp.enabled and world_size > 1 and not plan["fsdp"].active:
        group = gpus_per_node if cfg.fsdp.strategy == "hybrid_shard" and gpus_per_node else world_size
        setup = setup.replace(fsdp=cfg.fsdp.strategy, shard_group=group, cpu_offload=cfg.fsdp.cpu_offload,
                              gather_bytes=setup.compute_bytes if setup.compute_bytes < setup.weight_bytes else 0)
        notes.append(f"FSDP {cfg.fsdp.strategy} over {world_size} ranks (shard groups of {group}) modelled as "
                     f"configured (this process, outside a launcher, plans no sharding: {plan['fsdp'].reason})")
    if plan["deepspeed"].active:
        notes.append(zero_note(plan["deepspeed"].settings, world_size))
    # what the plan could not do here (QLoRA without CUDA -> LoRA, 8-bit -> fused AdamW, ...) is what is estimated
    notes += [f"{name}: {fb} (estimated as planned here)" for name, d in plan.decisions.items() for fb in d.fallbacks]
    result = estimate(info.shape, setup)
    return dataclasses.replace(result, notes=tuple(notes) + result.notes, plan_changes=tuple(changes))


def cheapest_fit(described: tuple[ModelInfo, bool], config: SpeedupConfig, memory_bytes: int, *, seq_len: int,
                 **kwargs: Any) -> tuple[MemoryEstimate | None, str]:
    """What ``memory.budget = memory_bytes`` would choose: (its estimate, the changes) or (None, why nothing fits)."""
    cfg = config.replace(memory={"budget": int(memory_bytes), "seq_len": seq_len})
    try:
        est = estimate_described(described, cfg, seq_len=seq_len, **kwargs)
    except SpeedupConfigError as exc:
        return None, "; ".join(exc.problems)
    return est, "; ".join(est.plan_changes) or "none needed"


def fits_text(est: MemoryEstimate, memory_bytes: int | None, where: str) -> str:
    if not memory_bytes:
        return f"device memory unknown ({where}): pass --memory"
    room = memory_bytes - est.total_bytes
    verdict = "fits" if room >= 0 else "does NOT fit"
    return (f"{verdict} in {fmt_bytes(memory_bytes)} ({where}): "
            f"{fmt_bytes(abs(room))} {'to spare' if room >= 0 else 'short'}")


# ------------------------------------------------------------------------------------- the longest sequence
def per_token(bytes_at: Callable[[int], float], seq_len: int, batch_size: int = 1) -> tuple[float, float]:
    """(bytes per token of the micro-batch, bytes at 0 tokens) of an estimate ``bytes_at(seq_len)``, from two lengths:
    ``seq_len`` and half of it. The memory model is linear in the length only piecewise (the loss chunk grows until
    it is full, eager attention keeps ``heads x length`` per token), so this is the secant over the upper half, the
    slope where the answer lies; a token more in each of ``batch_size`` rows adds ``batch_size`` tokens."""
    low = max(1, seq_len // 2)
    high_bytes = float(bytes_at(seq_len))
    if low >= seq_len:
        return 0.0, high_bytes
    slope = (high_bytes - float(bytes_at(low))) / (seq_len - low)
    return slope / batch_size, high_bytes - slope * seq_len


@dataclasses.dataclass(frozen=True)
class LongestSequence:
    """The longest row (tokens) a plan trains within ``budget_bytes``: ``estimate`` fits, ``over`` (at ``seq_len +
    step``) does not. ``seq_len`` None: not even ``step`` tokens fit (``estimate`` is then at ``step``)."""

    seq_len: int | None
    budget_bytes: int
    step: int
    batch_size: int
    estimate: MemoryEstimate
    over: MemoryEstimate | None  # None where the longest searched (length.LIMIT) still fits
    bytes_per_token: float  # per token of the micro-batch, the slope between seq_len / 2 and seq_len (per_token)
    constant_bytes: float  # the estimate extrapolated to 0 tokens along that slope
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["estimate"] = self.estimate.to_dict()
        out["over"] = self.over.to_dict() if self.over is not None else None
        return out


def budget_from(value: Any, caps: Capabilities, field: str = "budget") -> int:
    """Bytes of a budget: an int, a size text (``20GiB``, ``24GB``), ``auto`` (this device's memory) or a fraction of
    it; one SpeedupConfigError naming ``field`` otherwise."""
    from .config import AUTO
    from .features.memory.budget import budget_bytes

    ok = value is not None and (value == AUTO or (isinstance(value, float) and 0 < value <= 1)
                                or parse_size(value) is not None)
    n, why = budget_bytes(value, caps) if ok else (None, "")
    if n is None:
        raise SpeedupConfigError([f"{field} = {value!r} " + (f"cannot be sized here: {why}" if why else
                                                              "is not a memory size") +
                                  "; allowed: bytes as an integer, a size such as '20GiB' or '80GB', 'auto' (this "
                                  "device's memory) or a fraction of it such as 0.9; fix: e.g. "
                                  f"{field}='20GiB'"])
    return n


def longest_sequence(model_or_config: Any, *, speedup: Any = "auto", budget: Any, batch_size: int = 1,
                     step: int = 1, world_size: int = 1, gradient_accumulation_steps: int = 1,
                     caps: Capabilities | None = None, padded: bool = False, args: Any = None,
                     trust_remote_code: bool = False) -> LongestSequence:
    """The longest sequence (tokens per row, a multiple of ``step``) ``speedup`` trains within ``budget`` on this
    machine (or ``caps``): searched on the estimate itself (doubling, then bisection), since the memory model is not
    linear in the length everywhere; the slope (bytes per token) and the constant (bytes at 0 tokens) come with it.
    ``budget``: bytes, ``'20GiB'``, ``'auto'`` (this device's memory) or a fraction of it. Other arguments as
    :func:`estimate_memory`."""
    if not all(isinstance(v, int) and v >= 1 for v in (batch_size, step, world_size, gradient_accumulation_steps)):
        raise SpeedupConfigError([f"batch_size = {batch_size!r}, step = {step!r}, world_size = {world_size!r}, "
                                  f"gradient_accumulation_steps = {gradient_accumulation_steps!r}: allowed: integers "
                                  ">= 1; fix: e.g. batch_size=1, step=64"])
    cfg = resolve(speedup)
    caps = caps if caps is not None else probe(args)
    budget_bytes = budget_from(budget, caps)  # a bad budget fails before any model is built
    described = describe_for_estimate(model_or_config, trust_remote_code)
    caps = measure(cfg, caps, described[0])
    return longest_described(described, cfg, budget_bytes=budget_bytes, caps=caps, batch_size=batch_size, step=step,
                             world_size=world_size, gradient_accumulation_steps=gradient_accumulation_steps,
                             padded=padded, args=args)


def longest_described(described: tuple[ModelInfo, bool], cfg: SpeedupConfig, *, budget_bytes: int,
                      caps: Capabilities, batch_size: int = 1, step: int = 1, **kwargs: Any) -> LongestSequence:
    """:func:`longest_sequence` for a model already described and a resolved config (the CLI's door)."""
    from .features.memory.budget import _quiet
    from .features.memory.length import longest

    seen: dict[int, MemoryEstimate | None] = {}

    def at(tokens: int) -> MemoryEstimate | None:
        """The estimate at rows of ``tokens``, None where memory.budget finds no configuration for them."""
        if tokens not in seen:
            try:
                seen[tokens] = estimate_described(described, cfg, batch_size=batch_size, seq_len=tokens, caps=caps,
                                                  **kwargs)
            except SpeedupConfigError:
                if not seen:
                    raise  # the first length: the plan's own error, said once
                seen[tokens] = None
        return seen[tokens]

    def fits(tokens: int) -> bool:
        est = at(tokens)
        return est is not None and est.total_bytes <= budget_bytes

    first = at(step)  # planned (and logged) once; every other length quietly
    with _quiet():
        found, capped = longest(fits, step)
        if found is None:
            return LongestSequence(None, budget_bytes, step, batch_size, first, first, 0.0, 0.0,
                                   (f"{step} token(s) per row already need {fmt_bytes(first.total_bytes)}",))
        slope, constant = per_token(lambda n: at(n).total_bytes, found, batch_size)
        over = None if capped else at(found + step)
    notes = list(first.notes)
    if capped:
        notes.append(f"still fits at {found:,} tokens, the longest searched")
    elif over is None:
        notes.append(f"at {found + step:,} tokens memory.budget finds no configuration that fits")
    return LongestSequence(found, budget_bytes, step, batch_size, at(found), over, slope, constant, tuple(notes))
