"""``memory.budget``: before any model work, the plan picks the fastest configuration predicted to fit.

The prediction is :func:`hf_speedup.memory_model.estimate` for what the plan decided (precision, LoRA,
FSDP, checkpointing, attention, optimizer, loss). When it exceeds the budget, configurations are tried in
this order, each with the largest micro-batch that fits (the effective batch ``micro-batch x gradient
accumulation`` is always kept):

1. a smaller micro-batch with more gradient accumulation (no recomputation, same math);
2. selective activation checkpointing, every 4th, 3rd, 2nd block;
3. checkpointing every block;
4. 8-bit AdamW states (bitsandbytes; skipped where it cannot run);
5. chunked cross-entropy (the full logits never exist).

Each try is recorded with its predicted bytes and reported. LoRA and QLoRA change what is trained, so the
budget never turns them on: when only they would fit, the plan stops with an error that says so.

The sequence length comes from ``memory.seq_len``, else the arguments' ``max_length`` / ``max_seq_length``
(TRL's SFTConfig), else the plan stops with an error naming ``memory.seq_len``.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from ...config import AUTO, SpeedupConfig, SpeedupConfigError, parse_size
from ...memory_model import LoraShape, MemoryEstimate, MlpTiles, TrainingSetup, estimate, fmt_bytes
from ...model_shape import ModelShape
from ...plan_types import Decision, PlanContext
from .. import checkpointing, optimizer
from ..deepspeed import engine, zero_sharding, zero_stage
from ..checkpointing import selected_blocks
from ..liger import fused_loss_elsewhere

logger = logging.getLogger("hf_speedup")

# TrainingArguments.optim -> the memory model's optimizer kind
OPTIM_KIND = {"adamw_torch_fused": "adamw_fused", "adamw_torch": "adamw", "adamw_bnb_8bit": "adamw_8bit",
              "adamw_8bit": "adamw_8bit", "paged_adamw_8bit": "paged_adamw_8bit"}
EVERY_N = (4, 3, 2)  # selective checkpointing, least recomputation first


# ------------------------------------------------------------------------------------------ plan -> setup
def _settings(decisions: Mapping[str, Decision], name: str):
    d = decisions.get(name)
    return d.settings if d is not None and d.active else None


def training_setup(decisions: Mapping[str, Decision], shape: ModelShape, caps, *, micro_batch: int, seq_len: int,
                   grad_accum: int = 1, weight_bytes: int | None = None, padded: bool = False,
                   chunked: bool | None = None, chunk_tokens: int = 1024) -> TrainingSetup:
    """What the memory model needs of a plan's decisions (``chunked`` overrides the loss decision)."""
    prec = decisions.get("precision")
    dtype = prec.settings.dtype if prec is not None else torch.float32
    wb = weight_bytes or shape.weight_bytes
    compute = 2 if (dtype in (torch.bfloat16, torch.float16) or wb == 2) else 4
    lora = None
    if (ls := _settings(decisions, "lora")) is not None:
        targets = ls.target_modules if isinstance(ls.target_modules, str) else tuple(ls.target_modules)
        lora = LoraShape(rank=ls.r, targets=targets, dropout=ls.dropout, quantized=ls.quantization == "4bit",
                         expert_targets=tuple(ls.target_parameters))
    ck = decisions.get("checkpointing")
    blocks: tuple[int, ...] = ()
    if ck is not None and ck.settings.by is not None:
        every = ck.settings.every_n_blocks if ck.settings.by == "hf_speedup" else 1
        blocks = tuple(selected_blocks(shape.num_blocks, every))
    opt = decisions.get("optimizer")
    kind = OPTIM_KIND.get(opt.settings.optim, "other") if opt is not None else "adamw_fused"
    loss = decisions.get("loss")
    if chunked is None:
        chunked = bool(loss is not None and loss.active and getattr(loss.settings, "chunked", False))
        if chunked:
            chunk_tokens = getattr(loss.settings, "chunk_tokens", None) or chunk_tokens
        if not chunked and fused_loss_elsewhere(decisions.get("liger")):  # no full logits either
            chunked = True  # modelled as the chunked loss with its default chunk
    attn = _settings(decisions, "attention")
    experts = decisions.get("experts")  # the kernel planned, else the model's own (keep)
    kernel = (experts.settings.implementation or experts.settings.previous) if experts is not None else None
    data = _settings(decisions, "data")
    fs = _settings(decisions, "fsdp")
    fsdp = dict(fsdp=None)
    if fs is not None:
        gather = fs.mixed_precision.param_dtype.itemsize if fs.mixed_precision is not None else 0
        fsdp = dict(fsdp=fs.strategy, shard_group=fs.mesh.shape[-1], cpu_offload=fs.cpu_offload, gather_bytes=gather)
    elif (zero := zero_sharding(_settings(decisions, "deepspeed"), caps.world_size)) is not None:
        fsdp = zero
    comp = decisions.get("compile")
    # from the first step, partitioned by AOT autograd, without CUDA graphs (their static buffers and pools differ)
    compiled = bool(comp is not None and comp.active and getattr(comp.settings, "when", "always") == "always"
                    and getattr(comp.settings, "backend", "inductor") not in ("eager", "cudagraphs")
                    and getattr(comp.settings, "mode", None) in (None, "default", "max-autotune-no-cudagraphs"))
    return TrainingSetup(
        micro_batch=micro_batch, seq_len=seq_len, grad_accum=grad_accum, weight_bytes=wb, compute_bytes=compute,
        autocast=dtype in (torch.bfloat16, torch.float16), mlp_tiles=MlpTiles.of(_settings(decisions, "tiled_mlp")),
        offload_inputs=bool(blocks) and bool(getattr(getattr(ck, "settings", None), "offload", False)),
        compiled=compiled, lora=lora, checkpointed=blocks, optimizer=kind, chunked_loss=chunked,
        chunk_tokens=chunk_tokens,
        attention=getattr(attn, "implementation", None) or shape.attention, experts=kernel or "eager",
        attention_form=getattr(attn, "form", None),
        padded=padded and not getattr(data, "padding_free", False),
        use_cache=shape.use_cache and not blocks, device=caps.device_type, **fsdp)


# ------------------------------------------------------------------------------------------ the budget
@dataclass(frozen=True)
class FitStep:
    level: str  # the configuration tried ("as planned", "checkpointing every 4 blocks", ...)
    micro_batch: int = 0
    grad_accum: int = 1
    bytes: int = 0  # predicted peak (0 where skipped)
    fits: bool = False
    skipped: str | None = None  # why this level could not be tried here

    @property
    def label(self) -> str:
        if self.skipped:
            return f"{self.level}: skipped ({self.skipped})"
        return f"{self.level}, micro-batch {self.micro_batch}" + (
            f" x {self.grad_accum} accumulation" if self.grad_accum > 1 else "")


@dataclass(frozen=True)
class BudgetFit:
    """What the budget found: every configuration tried, the one chosen and what it changes."""

    budget_bytes: int
    budget_text: str
    seq_len: int
    steps: tuple[FitStep, ...]
    predicted_bytes: int  # of the configuration chosen (the first step when nothing had to change)
    micro_batch: int | None = None  # TrainingArguments overrides, where the micro-batch changed
    grad_accum: int | None = None
    changes: tuple[tuple[str, Any], ...] = ()  # config fields the later decisions follow

    @property
    def changed(self) -> bool:
        return bool(self.changes) or self.micro_batch is not None


def budget_bytes(value: Any, caps) -> tuple[int | None, str]:
    """(bytes, how they were read) of ``memory.budget``; (None, why) where the device's size is unknown."""
    device = caps.memory_bytes
    where = f"{caps.device_name} ({caps.device_type})"
    if value == AUTO or (isinstance(value, float) and 0 < value <= 1):
        frac = 1.0 if value == AUTO else float(value)
        if not device:
            return None, f"the memory of {where} is unknown"
        text = "auto: all of" if value == AUTO else f"{frac:g} of"
        return int(device * frac), f"{text} {fmt_bytes(device)} on {where}"
    n = parse_size(value)
    return n, str(value)


def seq_len_for(ctx: PlanContext) -> tuple[int, str]:
    s = ctx.config.memory.seq_len
    if s:
        return s, "memory.seq_len"
    for name in ("max_length", "max_seq_length"):
        v = getattr(ctx.args, name, None) if ctx.args is not None else None
        if isinstance(v, int) and v > 0:
            return v, f"the arguments' {name}"
    raise SpeedupConfigError([
        f"memory.budget = {ctx.config.memory.budget!r} needs the sequence length to estimate activations, and "
        "memory.seq_len = None (the TrainingArguments have no max_length either); allowed: an integer >= 1; "
        "fix: set memory.seq_len to the longest row of your batches, e.g. memory.seq_len: 2048"
    ])


@contextlib.contextmanager
def _quiet():
    """Trial decisions log nothing (their fallbacks are logged once, when the plan itself decides)."""
    class Drop(logging.Filter):
        def filter(self, record):
            return False

    f = Drop()
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


class _Trial:
    """Re-decides checkpointing and the optimizer for an amended config, and estimates the result."""

    def __init__(self, ctx: PlanContext, seq_len: int, micro_batch: int, grad_accum: int):
        self.ctx, self.seq_len = ctx, seq_len
        self.effective = micro_batch * grad_accum
        self.shape: ModelShape = ctx.model.shape

    def config(self, changes: Mapping[str, Any]) -> SpeedupConfig:
        sections: dict = {}
        for key, value in changes.items():
            section, field = key.split(".")
            sections.setdefault(section, {})[field] = value
        # the budget's amendments are not the user's choices: an explicit TrainingArguments value still wins over them
        return self.ctx.config.replace(**sections).with_explicit_fields(self.ctx.config.explicit_fields()) \
            if sections else self.ctx.config

    def decisions(self, changes: Mapping[str, Any]) -> dict[str, Decision]:
        ctx = self.ctx
        out = dict(ctx.decisions)
        if not any(k.startswith(("checkpointing.", "optimizer.")) for k in changes):
            return out
        trial = PlanContext(config=self.config(changes), caps=ctx.caps, model=ctx.model, args=ctx.args,
                            decisions=dict(ctx.decisions))
        with _quiet():
            for feature in (checkpointing, optimizer):
                out[feature.NAME] = trial.decisions[feature.NAME] = feature.decide(trial)
        return out

    def estimate(self, changes: Mapping[str, Any], micro_batch: int) -> MemoryEstimate:
        cfg = self.config(changes)
        return estimate(self.shape, training_setup(
            self.decisions(changes), self.shape, self.ctx.caps, micro_batch=micro_batch, seq_len=self.seq_len,
            grad_accum=self.effective // micro_batch, chunked=loss_would_chunk(self.ctx, cfg),
            chunk_tokens=getattr(getattr(cfg, "loss", None), "chunk_tokens", 1024)))


def loss_would_chunk(ctx: PlanContext, cfg: SpeedupConfig) -> bool:
    """The loss feature decides after the budget: chunked unless FSDP, a compiled stock head or a head other than
    a causal LM's stand in the way."""
    loss = getattr(cfg, "loss", None)
    if loss is None or loss.chunked is not True:
        return False
    if ctx.model is not None and ctx.model.head != "causal_lm":
        return False
    fsdp, comp = ctx.decisions.get("fsdp"), ctx.decisions.get("compile")
    if fsdp is not None and fsdp.active:
        return False
    return not (comp is not None and comp.active and getattr(comp.settings, "regions", None) == "blocks+head")


def _micro_batches(ctx: PlanContext, micro_batch: int, effective: int) -> list[int]:
    """Micro-batches that keep the effective batch exactly: divisors of it, from the user's down to 1; the user's
    alone where a DeepSpeed config fixes the batch (its values win over TrainingArguments')."""
    if engine(ctx).fixed_batch:
        return [micro_batch]
    return [m for m in range(micro_batch, 0, -1) if effective % m == 0]


def _levels(trial: _Trial) -> list[tuple[str, dict, str | None]]:
    """(label, config changes, why skipped) in the budget's order, each adding to the one before."""
    ctx, L = trial.ctx, trial.shape.num_blocks
    ck = ctx.decisions.get("checkpointing")
    every_now = (ck.settings.every_n_blocks if ck.settings.by == "hf_speedup" else 1) if (
        ck is not None and ck.settings.by is not None) else None
    levels: list[tuple[str, dict, str | None]] = [("as planned", {}, None)]
    changes: dict = {}
    for n in EVERY_N:
        if n < L and (every_now is None or every_now > n):
            changes = {"checkpointing.enabled": True, "checkpointing.every_n_blocks": n}
            levels.append((f"checkpointing every {n} blocks", dict(changes), None))
    if every_now != 1:
        changes = {"checkpointing.enabled": True, "checkpointing.every_n_blocks": 1}
        levels.append(("checkpointing every block", dict(changes), None))
    opt = ctx.decisions.get("optimizer")
    if opt is None or OPTIM_KIND.get(opt.settings.optim) not in ("adamw_8bit", "paged_adamw_8bit"):
        ok, why = optimizer.runnable("adamw_8bit", ctx.caps, optimizer.shards_with_fsdp2(ctx))
        if ok and zero_stage(ctx) is not None:
            ok, why = False, f"under DeepSpeed ZeRO-{zero_stage(ctx)}: {optimizer.ZERO_8BIT}"
        changes = {**changes, "optimizer.name": "adamw_8bit"} if ok else changes
        levels.append(("+ 8-bit AdamW states", dict(changes), None if ok else why))
    if getattr(ctx.config, "loss", None) is not None and ctx.config.loss.chunked is False:
        levels.append(("+ chunked cross-entropy", dict(changes), "loss.chunked: false in your config (auto lets the "
                                                                 "budget choose it)"))
    elif getattr(ctx.config, "loss", None) is not None and not loss_would_chunk(ctx, ctx.config):
        chunk = {**changes, "loss.chunked": True}
        ok = loss_would_chunk(ctx, trial.config(chunk))
        levels.append(("+ chunked cross-entropy", chunk if ok else dict(changes),
                       None if ok else "the loss cannot be chunked here (FSDP, a compiled stock head, or not a "
                                                  "causal-LM head)"))
    return levels


def fit(ctx: PlanContext) -> tuple[BudgetFit | None, str | None]:
    """The budget's choice, or (None, why not checked). Raises when nothing without LoRA fits."""
    s = ctx.config.memory
    budget, text = budget_bytes(s.budget, ctx.caps)
    if budget is None:
        return None, f"memory.budget not checked: {text}"
    if ctx.model is None or getattr(ctx.model, "shape", None) is None:
        return None, "memory.budget not checked: no model to size (plan without a model, or no repeated decoder block)"
    seq, _ = seq_len_for(ctx)
    args = ctx.args
    mb0 = int(getattr(args, "per_device_train_batch_size", 8) or 8)
    ga0 = int(getattr(args, "gradient_accumulation_steps", 1) or 1)
    trial = _Trial(ctx, seq, mb0, ga0)
    steps: list[FitStep] = []
    for level, changes, skipped in _levels(trial):
        if skipped:
            steps.append(FitStep(level, skipped=skipped))
            continue
        for mb in _micro_batches(ctx, mb0, mb0 * ga0):
            ga = mb0 * ga0 // mb
            est = trial.estimate(changes, mb)
            ok = est.total_bytes <= budget
            steps.append(FitStep(level, mb, ga, est.total_bytes, ok))
            if ok:
                return BudgetFit(budget_bytes=budget, budget_text=text, seq_len=seq, steps=tuple(steps),
                                 predicted_bytes=est.total_bytes, micro_batch=mb if mb != mb0 else None,
                                 grad_accum=ga if mb != mb0 else None, changes=tuple(changes.items())), None
    raise SpeedupConfigError([_nothing_fits(trial, budget, text, steps)])


def _nothing_fits(trial: _Trial, budget: int, text: str, steps: list[FitStep]) -> str:
    """The error when nothing without LoRA fits: the smallest try, and what LoRA / QLoRA would need."""
    smallest = min((s for s in steps if s.bytes), key=lambda s: s.bytes)
    ctx = trial.ctx
    alternatives = []
    if not (ctx.config.lora.enabled):
        leanest = dict(_levels(trial)[-1][1])
        for label, qlora in (("LoRA (lora.enabled: true)", False),
                             ("QLoRA (lora.enabled: true, lora.quantization: 4bit; CUDA)", True)):
            need = _with_lora(trial, leanest, qlora)
            verdict = "fits" if need <= budget else "over as well"
            alternatives.append(f"{label}: {fmt_bytes(need)}, {verdict}")
    lora_text = ("; with adapters instead (r={}, every Linear, same leanest settings, micro-batch 1): ".format(
        ctx.config.lora.r) + "; ".join(alternatives)) if alternatives else ""
    how = "" if text == str(ctx.config.memory.budget) else f"; {text}"
    return (f"memory.budget = {ctx.config.memory.budget!r} ({fmt_bytes(budget)}{how}): no configuration "
            f"hf_speedup may choose is predicted to fit; the smallest, {smallest.label}, needs "
            f"{fmt_bytes(smallest.bytes)}{lora_text}; allowed: a budget of at least {fmt_bytes(smallest.bytes)} for "
            "this model, batch and sequence length; fix: raise memory.budget, shorten memory.seq_len, shard with "
            "fsdp over more devices" + (", or turn LoRA on yourself (hf_speedup never switches to adapters behind "
                                        "your back)" if alternatives else ""))


def _with_lora(trial: _Trial, changes: dict, qlora: bool) -> int:
    """Predicted bytes with LoRA/QLoRA adapters on every Linear of the blocks, micro-batch 1, ``changes`` applied
    (the base loads in the plan's compute dtype, as ``load_model`` loads a frozen base: bf16 where the precision
    feature chose it, by the CPU flag or by measurement, fp32 where it did not)."""
    ctx = trial.ctx
    cfg = trial.config(changes)
    setup = training_setup(trial.decisions(changes), trial.shape, ctx.caps, micro_batch=1, seq_len=trial.seq_len,
                           grad_accum=trial.effective, chunked=loss_would_chunk(ctx, cfg),
                           chunk_tokens=getattr(getattr(cfg, "loss", None), "chunk_tokens", 1024))
    compute = 2 if qlora else setup.compute_bytes
    lora = LoraShape(rank=ctx.config.lora.r, targets="all-linear", dropout=ctx.config.lora.dropout, quantized=qlora,
                     expert_targets="all")
    setup = setup.replace(lora=lora, compute_bytes=compute, weight_bytes=compute, optimizer="adamw_fused")
    return estimate(trial.shape, setup).total_bytes


def describe(fit_: BudgetFit) -> str:
    """The reason text: the budget, every try with its predicted bytes (grouped by level), what was chosen."""
    head = f"memory.budget {fmt_bytes(fit_.budget_bytes)} ({fit_.budget_text}), sequence length {fit_.seq_len}"
    if not fit_.changed:
        return f"{head}: predicted peak {fmt_bytes(fit_.predicted_bytes)} fits as planned"
    groups: dict[str, list[str]] = {}
    for st in fit_.steps:
        if st.skipped:
            groups[st.level] = [f"skipped ({st.skipped})"]
            continue
        mb = f"{st.micro_batch}" + (f"x{st.grad_accum}" if st.grad_accum > 1 else "")
        groups.setdefault(st.level, []).append(f"{mb}: {fmt_bytes(st.bytes)}" + (" fits" if st.fits else ""))
    tries = "; ".join(f"{level}: {', '.join(parts)}" for level, parts in groups.items())
    return (f"{head}: tried (micro-batch x accumulation: predicted peak) {tries}; chose {fit_.steps[-1].label} "
            f"({fmt_bytes(fit_.predicted_bytes)})")


def amend(ctx: PlanContext, fit_: BudgetFit) -> list[str]:
    """Make the plan follow the budget's choice: checkpointing and the optimizer (decided before the memory
    feature) are decided again with the amended config, their entries saying why; the features after it
    (the loss) read the amended config. The user's request stays in ``Plan.config``. Returns what changed."""
    if not fit_.changes:
        return []
    trial = _Trial(ctx, fit_.seq_len, 1, 1)
    cfg = trial.config(dict(fit_.changes))
    changed = [f"{k}: {_current(ctx.config, k)!r} -> {v!r}" for k, v in fit_.changes]
    why = f"set by memory.budget ({fmt_bytes(fit_.budget_bytes)}: predicted {fmt_bytes(fit_.predicted_bytes)})"
    redo = PlanContext(config=cfg, caps=ctx.caps, model=ctx.model, args=ctx.args, decisions=dict(ctx.decisions))
    for feature in (checkpointing, optimizer):
        if any(k.startswith(feature.NAME + ".") for k, _ in fit_.changes):
            old = ctx.decisions.get(feature.NAME)
            new = feature.decide(redo)
            redo.decisions[feature.NAME] = new
            ctx.decisions[feature.NAME] = new.replace(requested=old.requested if old is not None else new.requested,
                                                      reason=f"{why}; {new.reason}")
    ctx.config = cfg  # for the features deciding after the memory feature (loss.chunked)
    return changed


def _current(cfg: SpeedupConfig, key: str) -> Any:
    section, field = key.split(".")
    return getattr(getattr(cfg, section), field)
