"""Activation (gradient) checkpointing: non-reentrant, on every N-th repeated block, done exactly once.

Who checkpoints is one decision (``settings.by``):

- ``hf_speedup``: this module sets it on the blocks in :func:`apply` (per-block flags of transformers'
  ``GradientCheckpointingLayer``), so ``every_n_blocks`` works and the Trainer's own switch stays off.
  Blocks ``0, n, 2n, ...`` are checkpointed (transformers' ``every_n_layers`` convention: the first
  block always is). It is applied before regional compile, which compiles the blocks in place: the
  checkpoint is then traced inside each compiled region and recomputed there.
- ``fsdp``: the FSDP decision says FSDP wraps the blocks with its own checkpointing, so not here.
- ``trainer``: the user's TrainingArguments ask for it and this config does not (``baseline``): the
  stock Trainer does it, unchanged.

Non-reentrant checkpointing needs no ``enable_input_require_grads`` hack for LoRA (only reentrant
does), keeps RNG state (dropout recomputes identically) and works under ``torch.compile``.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass

import torch

from ... import compat
from ...blocks import find_blocks
from ...config import SpeedupConfigError
from ...plan_types import OFF, Decision, Outcome, PlanContext
from ..explicit_args import users_choice
from ..probe import eager_train_mode
from .mechanism import block_checkpoint_fn, disable_kv_cache, enable_block_checkpointing, is_non_reentrant, offloader_of
from .offload import BlockInputOffloader

NAME = "checkpointing"
APPLIES_TO = "model"
logger = logging.getLogger("hf_speedup")


@dataclass(frozen=True)
class Settings:
    by: str | None = None  # hf_speedup | fsdp | trainer | None (nobody)
    every_n_blocks: int = 1
    blocks: tuple[int, ...] | None = None  # the block indices to checkpoint, where the model is known
    override_args: bool = False  # the user's TrainingArguments asked for it: their switch is turned off
    offload: bool = False  # the blocks' inputs kept in pinned host memory, copies on a side stream (offload.py)


# ----------------------------------------------------------------------------------------- decide
def _user_args_want_it(args) -> bool:
    """Whether the user's TrainingArguments already turn checkpointing on (either spelling)."""
    if args is None:
        return False
    flag, _ = compat.checkpointing_arg_names(type(args))
    return bool(getattr(args, flag, False) or getattr(args, "gradient_checkpointing", False))


def _user_kwargs(args) -> dict:
    """The checkpointing kwargs in the user's TrainingArguments (either spelling)."""
    if args is None:
        return {}
    _, name = compat.checkpointing_arg_names(type(args))
    return dict(getattr(args, name, None) or getattr(args, "gradient_checkpointing_kwargs", None) or {})


def _beyond_blocks(kwargs: dict) -> dict:
    """What the user's kwargs ask for that per-block non-reentrant checkpointing is not (TRL's ``selective``,
    a ``use_reentrant=True`` a custom block may depend on, ...)."""
    return {k: v for k, v in kwargs.items() if not (k == "use_reentrant" and v is False) and k != "every_n_layers"}


def _ordinal(n: int) -> str:
    return {1: "every", 2: "every 2nd", 3: "every 3rd"}.get(n, f"every {n}th")


def selected_blocks(num_blocks: int, every_n: int) -> list[int]:
    """Blocks 0, n, 2n, ...: the first block is always checkpointed (transformers' convention)."""
    return [i for i in range(num_blocks) if i % every_n == 0]


def decide(ctx: PlanContext) -> Decision:
    s = ctx.config.checkpointing
    requested = {"enabled": s.enabled, "every_n_blocks": s.every_n_blocks, "offload": s.offload}
    user_on = _user_args_want_it(ctx.args)
    fsdp = ctx.decisions.get("fsdp")
    if fsdp is not None and fsdp.active and fsdp.settings.activation_checkpointing:
        kept = ("; block inputs not offloaded (checkpointing.offload): FSDP's checkpoint wrapper holds them"
                if s.offload is not False and ctx.caps.device_type == "cuda" else "")
        return Decision(NAME, requested, "by fsdp", settings=Settings(by="fsdp", override_args=user_on),
                        reason="FSDP wraps the blocks with its own activation checkpointing (fsdp decision); "
                               f"done once, there, not here{kept}")
    flag, _ = compat.checkpointing_arg_names(type(ctx.args)) if ctx.args is not None else (None, None)
    explicit, value = users_choice(ctx.args, flag) if flag else (False, None)
    if explicit and value is False and s.enabled is True and "checkpointing.enabled" in ctx.config.explicit_fields():
        raise SpeedupConfigError([
            f"checkpointing.enabled = true (your config) and TrainingArguments.{flag} = False ask for opposite "
            f"things; allowed: one choice; fix: drop {flag} from TrainingArguments, or set checkpointing.enabled: "
            "false"])
    if explicit and value is False and s.enabled is not False:
        return Decision(NAME, requested, OFF, settings=Settings(),
                        reason=f"kept your TrainingArguments.{flag}=False over the preset's checkpointing (an "
                               "explicit TrainingArguments choice wins over a preset)")
    if s.enabled is False:
        if user_on:
            return Decision(NAME, requested, "by trainer", settings=Settings(by="trainer"),
                            reason="off in the config, but the TrainingArguments turn it on: the stock Trainer "
                                   "checkpoints every block, unchanged")
        return Decision(NAME, requested, OFF, settings=Settings(),
                        reason="off in the config (trades ~30% step time for activation memory)")
    theirs = _beyond_blocks(_user_kwargs(ctx.args)) if user_on else {}
    if s.enabled == "auto" and theirs:
        return Decision(NAME, requested, "by trainer", settings=Settings(by="trainer"),
                        reason=f"auto: the TrainingArguments ask for checkpointing with {theirs}, which hf_speedup's "
                               "per-block checkpointing does not do: the trainer's own runs, unchanged")
    if s.enabled == "auto" and not user_on:
        return Decision(NAME, requested, OFF, settings=Settings(),
                        reason="auto: off; no memory estimate says the activations will not fit, and recomputation "
                               "costs ~30% step time; set checkpointing.enabled: true to force it")
    return _decide_blocks(ctx, requested, user_on)


def _decide_blocks(ctx: PlanContext, requested: dict, user_on: bool) -> Decision:
    n = ctx.config.checkpointing.every_n_blocks
    info = ctx.model
    why = "requested" if ctx.config.checkpointing.enabled is True else "auto: the TrainingArguments ask for it"
    if user_on:
        why += "; taken over from TrainingArguments (applied per block here, the Trainer's switch is turned off)"
        theirs = _beyond_blocks(_user_kwargs(ctx.args))
        if theirs:
            why += f"; their {theirs} replaced by non-reentrant per-block checkpointing"
    if info is not None and info.num_blocks == 0:
        return Decision(NAME, requested, OFF, settings=Settings(),
                        fallbacks=("checkpointing: no repeated block found in the model",),
                        reason="cannot checkpoint: no repeated decoder block found (no _no_split_modules, no "
                               "homogeneous ModuleList)")
    blocks = tuple(selected_blocks(info.num_blocks, n)) if info is not None else None
    offload, offload_why = _decide_offload(ctx)
    settings = Settings(by="hf_speedup", every_n_blocks=n, blocks=blocks, override_args=user_on, offload=offload)
    if info is not None:
        where = f"{len(blocks)}/{info.num_blocks} {info.block_class} blocks ({_ordinal(n)})"
    else:
        where = f"{_ordinal(n)} block"
    applied = "non-reentrant" if n == 1 else f"non-reentrant, every {n} blocks"
    if offload:
        applied += ", inputs offloaded"
    return Decision(NAME, requested, applied, settings=settings,
                    reason=f"{why}: {where}, non-reentrant, use_cache off{offload_why}")


def _decide_offload(ctx: PlanContext) -> tuple[bool, str]:
    """Whether the checkpointed blocks' inputs go to host memory, and the reason's words for it."""
    asked = ctx.config.checkpointing.offload
    if asked is False:
        return False, ""
    if ctx.caps.device_type != "cuda":
        return False, (f"; inputs not offloaded (checkpointing.offload={asked!r}): on a {ctx.caps.device_type} device "
                       "they already live in host memory, there is nothing to offload to")
    return True, ("; each block's input kept in pinned host memory between forward and backward (hf_speedup's "
                  "offloader: copies on a side stream, the next block's input prefetched during backward; "
                  "transformers' own offload copies on the compute stream with nothing prefetched)")


# ----------------------------------------------------------------------------------------- args
def training_args(decision: Decision, args) -> dict:
    """Turn the Trainer's own switch off where checkpointing is done elsewhere (never twice)."""
    if decision.settings.by not in ("hf_speedup", "fsdp") or not _user_args_want_it(args):
        return {}
    fields = compat.args_fields(type(args))
    flag, kwargs_name = compat.checkpointing_arg_names(type(args))
    off = {name: False for name in (flag, "gradient_checkpointing") if name in fields}
    # kwargs left behind with the switch off are an error to TRL (e.g. ``selective`` needs the switch on)
    off.update({name: None for name in (kwargs_name, "gradient_checkpointing_kwargs")
                if name in fields and getattr(args, name, None)})
    return off


def stock_trainer_args(decision: Decision, args=None) -> dict:
    """The TrainingArguments that make the *stock* Trainer do what this decision does (for
    ``training_arguments()`` users); ``{}`` where it cannot say it (selective on old transformers)."""
    if decision.settings.by != "hf_speedup":
        return {}
    from transformers import PreTrainedModel

    flag, kwargs_name = compat.checkpointing_arg_names(type(args) if args is not None else None)
    kwargs = {"use_reentrant": False}
    n = decision.settings.every_n_blocks
    if n > 1:
        enable = getattr(PreTrainedModel, "activation_checkpointing_enable", None)
        if enable is None or "every_n_layers" not in inspect.signature(enable).parameters:
            return {}
        kwargs["every_n_layers"] = n
    return {flag: True, kwargs_name: kwargs}


# ----------------------------------------------------------------------------------------- apply
def apply(decision: Decision, setup, outcome: Outcome) -> None:
    if decision.settings.by != "hf_speedup":
        return
    model = setup.model
    if model is None:
        logger.warning("hf_speedup: checkpointing not applied: no model (model_init is not supported)")
        return
    blocks = find_blocks(model)
    chosen = selected_blocks(len(blocks), decision.settings.every_n_blocks)
    offloader = BlockInputOffloader() if decision.settings.offload else None
    mechanism = enable_block_checkpointing(blocks, chosen, {"use_reentrant": False}, offloader=offloader)
    disable_kv_cache(model)
    outcome.facts.update(blocks=chosen, mechanism=mechanism)
    if offloader is not None:
        outcome.handoff["offloader"] = offloader
    logger.info("hf_speedup: activation checkpointing on blocks %s of %d (%s, non-reentrant)",
                chosen, len(blocks), mechanism)


# ----------------------------------------------------------------------------------------- verify
def checkpointed_blocks(model) -> list[int]:
    """Indices of the blocks set up to checkpoint when training (read from the modules themselves)."""
    wrapped = _fsdp_wrapped_ids(model)
    return [i for i, b in enumerate(find_blocks(model))
            if block_checkpoint_fn(b) is not None or id(b) in wrapped]


def _fsdp_wrapped_ids(model) -> set[int]:
    """Blocks inside torch's ``CheckpointWrapper`` (how FSDP / accelerate checkpoint)."""
    out = set()
    for m in model.modules():
        inner = getattr(m, "_checkpoint_wrapped_module", None)
        if inner is not None:
            out.add(id(inner))
    return out


def count_block_runs(model, seq_len: int = 8) -> dict[int, int] | None:
    """Run one tiny forward + backward and count how often each block's computation ran.

    A checkpointed block runs twice (forward, then recomputed in backward), others once. Counted
    with a pre-hook on the first parametrised leaf inside each block (the block's own hooks sit
    outside the checkpoint). Gradients go to the earliest trainable block through
    ``torch.autograd.grad``, so no ``.grad`` changes and every block from there on is traversed.
    Returns ``{block index: runs}`` for those blocks, or None where nothing is trainable.
    """
    blocks = find_blocks(model)
    first = next((i for i, b in enumerate(blocks) if any(p.requires_grad for p in b.parameters())), None)
    if first is None:
        return None
    params = [p for p in blocks[first].parameters() if p.requires_grad]
    counts = [0] * len(blocks)
    handles = [_first_leaf(b).register_forward_pre_hook(_counter(counts, i)) for i, b in enumerate(blocks)]
    emb = model.get_input_embeddings()
    ids = torch.arange(seq_len, device=emb.weight.device).unsqueeze(0) % emb.num_embeddings
    try:
        with eager_train_mode(model):
            out = model(input_ids=ids, use_cache=False)
            logits = out.logits if hasattr(out, "logits") else out[0]
            torch.autograd.grad(logits.float().mean(), params, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    return {i: counts[i] for i in range(first, len(blocks))}


def _first_leaf(block):
    return next(m for m in block.modules() if not list(m.children()) and any(True for _ in m.parameters(recurse=False)))


def _counter(counts: list[int], i: int):
    def hook(module, args):
        counts[i] += 1
    return hook


def _can_probe(trainer) -> tuple[bool, str]:
    """A probe step is safe only on one process with the model not yet sharded or wrapped."""
    args = getattr(trainer, "args", None)
    if getattr(args, "world_size", 1) > 1:
        return False, "several processes: checked structurally only"
    if getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_deepspeed_enabled", False):
        return False, "FSDP/DeepSpeed: checked structurally only"
    if any(type(p).__name__ == "DTensor" for p in trainer.model.parameters()):
        return False, "sharded parameters: checked structurally only"
    return True, ""


def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    model = trainer.model
    blocks = find_blocks(model)
    active = checkpointed_blocks(model)
    by = decision.settings.by
    if by is None:
        note = f"; note: {len(active)} block(s) have checkpointing on, set outside hf_speedup" if active else ""
        return False, f"off{note}"
    if not active:
        if by == "fsdp":
            return False, "FSDP has not wrapped the blocks yet (it does when training starts)"
        if by == "trainer":
            return False, "the stock Trainer turns it on when train() starts; not on yet"
        return False, f"no block has checkpointing on (0/{len(blocks)})"
    describe = _describe(blocks, active, decision)
    if decision.settings.offload:
        offloaders = {id(o): o for o in (offloader_of(block_checkpoint_fn(blocks[i])) for i in active) if o}
        if not offloaders:
            return False, f"{describe}, but no block keeps its input in host memory (offload was planned)"
        o = next(iter(offloaders.values()))
        describe += (f"; inputs kept in pinned host memory ({o.copies} copied out, {o.fetches} brought back so "
                     "far)")
    ok, why_not = _can_probe(trainer)
    if not ok:
        return True, f"{describe} ({why_not})"
    try:
        runs = count_block_runs(model)
    except Exception as exc:  # an unusual forward signature must not hide a structural success
        return True, f"{describe} (probe step failed, checked structurally only: {exc!r})"
    if runs is None:
        return True, f"{describe} (nothing trainable: recomputation not observed)"
    recomputed = [i for i, c in runs.items() if c >= 2]
    planned = decision.settings.blocks if decision.settings.blocks is not None else active
    expected = outcome.facts.get("blocks", planned) if by == "hf_speedup" else active
    expected = [i for i in expected if i in runs]
    if recomputed != expected:
        return False, f"{describe}, but one backward recomputed blocks {recomputed}, expected {expected}"
    return True, f"{describe}; one probe backward recomputed exactly blocks {_ranges(recomputed)}"


def _describe(blocks, active: list[int], decision: Decision) -> str:
    kinds = {is_non_reentrant(block_checkpoint_fn(blocks[i])) for i in active}
    reentrancy = "non-reentrant" if kinds == {True} else "reentrant" if kinds == {False} else "reentrancy unknown"
    n = decision.settings.every_n_blocks
    every = f", {_ordinal(n)}" if n and n > 1 else ""
    cls = type(blocks[active[0]]).__name__
    return f"{len(active)}/{len(blocks)} {cls} blocks ({_ranges(active)}{every}), {reentrancy}"


def _ranges(idx: list[int]) -> str:
    return ", ".join(str(i) for i in idx) if len(idx) <= 8 else f"{idx[0]}..{idx[-1]}"
