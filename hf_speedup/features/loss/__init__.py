"""Chunked cross-entropy: the causal-LM loss without the full-vocabulary logits and their gradient; and the
Trainer's loss scaling kept off heads that take their own mean.

With large vocabularies (SmolLM2: 49,152; Llama 3: 128,256) the ``tokens x vocab`` fp32 logits, their
log-softmax and their gradient are often the largest items at peak. ``loss.chunked`` computes the same
loss (transformers' ``ForCausalLMLoss``: shifted labels, ``-100`` ignored, ``num_items_in_batch`` for
gradient accumulation) in chunks of ``loss.chunk_tokens`` tokens, recomputing lm_head in backward
(:mod:`.chunked_cross_entropy`). The Trainer loop is the stock one: the model's own forward runs, its
lm_head passes the hidden states through and its ``loss_function`` applies the head chunk by chunk.

When chunked, a training forward with ``labels`` returns ``logits=None`` (they are never computed); in
eval mode, or without labels, the model is exactly the stock one (metrics and generation see logits).

- ``chunked: auto`` stays off here: the memory-budget plan turns it on when the logits do not fit;
  ``true`` turns it on, ``false`` keeps the stock loss.
- Only a causal-LM head has that loss: a masked LM, a classifier or any other head gets ``applied: off`` with a
  "not applicable: ..." reason, decided up front.
- Where the ``liger`` feature is on (CUDA, ``liger-kernel`` installed), Liger's fused linear cross-entropy
  (Triton) does the same job; the chunked loss then stays out (one of the two), with that reason.
- Not combined with FSDP (the sharded head weight would be read outside its module's forward) nor with
  ``compile.regions: blocks+head`` (which compiles the stock head and loss): reported as fallbacks.

Scaling (``loss.scaling: auto``; ``baseline`` keeps ``stock``): the Trainer takes a ``forward(**kwargs)`` for a
loss that divides by ``num_items_in_batch``, so it skips the division by ``gradient_accumulation_steps`` and
multiplies by the number of processes. Heads that take their own mean (classification, BERT's masked LM, T5/BART:
:func:`hf_speedup.model_parts.loss_takes_own_mean`) would train on a loss that many times too large; there
``attach`` sets ``trainer.model_accepts_loss_kwargs = False`` (what transformers' own ``accepts_loss_kwargs =
False`` models get), and the entry's reason says so. It does not change ``applied``/``engaged``, which speak of
the chunked loss.

Engagement rule: ``engaged`` is True iff the live model has the chunked path installed and a probe
forward in training mode with labels took it (``logits`` None) and gave the stock loss (fp32: relative
1e-4); after training steps, also iff the training forwards took it (a trainer that computes its loss
another way, e.g. TRL's fused head, leaves it unused: not engaged). A probe that disagrees with the stock
loss, or fails, uninstalls it (stock loss restored); so does a head apply finds it cannot serve. From then on the
report reads ``applied: withdrawn``, ``engaged: false``, with the reason, never as applied.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from ...blocks import unwrap_model
from ...model_parts import HEAD_NAMES
from ...plan_types import OFF, Decision, Outcome, PlanContext
from ..liger import fused_loss_elsewhere
from ..probe import eager_train_mode, steps_trained
from .chunked_cross_entropy import IGNORE_INDEX, install, installed_state, uninstall, unsupported_reason

NAME = "loss"
APPLIES_TO = "model"
logger = logging.getLogger("hf_speedup")
PROBE_TOKENS = 16
PROBE_REL = {torch.float32: 1e-4}  # other dtypes: 1e-2


@dataclass(frozen=True)
class Settings:
    chunked: bool = False
    chunk_tokens: int | None = None
    own_mean: bool = False  # the head takes its own mean: the Trainer's token-count scaling is turned off


# ------------------------------------------------------------------------------------------- decide
def decide(ctx: PlanContext) -> Decision:
    s = ctx.config.loss
    requested = {"chunked": s.chunked, "chunk_tokens": s.chunk_tokens, "scaling": s.scaling}
    decision = _chunking(ctx, requested)
    why = ctx.model.loss_own_mean if ctx.model is not None and s.scaling == "auto" else ""
    if not why:
        return decision
    return decision.replace(settings=dataclasses.replace(decision.settings, own_mean=True),
                            reason=f"{decision.reason}; {SCALING_OFF}: {why}")


SCALING_OFF = "the Trainer's token-count scaling turned off (model_accepts_loss_kwargs = False)"


def _chunking(ctx: PlanContext, requested: dict) -> Decision:
    s = ctx.config.loss
    if s.chunked is False:
        return Decision(NAME, requested, OFF, settings=Settings(),
                        reason="off in the config: the stock loss materialises the tokens x vocab fp32 logits")
    if s.chunked == "auto":
        return Decision(NAME, requested, OFF, settings=Settings(),
                        reason="auto: off; memory.budget turns it on when the estimate needs it to fit; set "
                               "loss.chunked: true to force it")
    liger = ctx.decisions.get("liger")
    if fused_loss_elsewhere(liger):
        who = ("Liger's fused linear cross-entropy (liger feature)" if "fused_linear_cross_entropy" in liger.applied
               else "TRL's fused LM head (Liger's layer kernels on, its loss off under TRL)")
        return Decision(NAME, requested, OFF, settings=Settings(),
                        reason=f"{who} already computes the loss without the full logits: the chunked loss stays out "
                               "(one of the two)")
    info = ctx.model
    if info is not None and info.head != "causal_lm":
        return Decision(NAME, requested, OFF, settings=Settings(),
                        reason=f"not applicable: {info.architecture} has {HEAD_NAMES.get(info.head, info.head)}; the "
                               "chunked loss replaces a causal LM's lm_head and shifted cross-entropy (the stock "
                               "loss is kept)")
    blocker = _blocker(ctx)
    if blocker:
        logger.warning("hf_speedup loss fallback: %s", blocker)
        return Decision(NAME, requested, OFF, settings=Settings(), reason=f"stock loss kept: {blocker}",
                        fallbacks=(f"chunked: {blocker}",))
    vocab = ctx.model.vocab_size if ctx.model is not None else None
    saved = f" (vocab {vocab:,}: {vocab * 4 / 1024:.0f} KiB of fp32 logits per token otherwise)" if vocab else ""
    why_not = f"; Liger's fused linear cross-entropy not used: {liger.reason}" if liger is not None else ""
    budget = getattr(getattr(ctx.decisions.get("memory"), "settings", None), "budget", None)
    by_budget = "set by memory.budget (see the memory entry); " if any(
        k == "loss.chunked" for k, _ in getattr(budget, "changes", ())) else ""
    return Decision(NAME, requested, f"chunked, {s.chunk_tokens} tokens", settings=Settings(True, s.chunk_tokens),
                    reason=f"{by_budget}lm_head + cross-entropy over chunks of {s.chunk_tokens} tokens, lm_head "
                           f"recomputed in backward: the full logits and their gradient never exist{saved}; logits "
                           f"are None in training forwards with labels{why_not}")


def _blocker(ctx: PlanContext) -> str | None:
    fsdp = ctx.decisions.get("fsdp")
    if fsdp is not None and fsdp.active:
        return "not combined with FSDP (the sharded lm_head weight would be read outside its module's forward)"
    compile_ = ctx.decisions.get("compile")
    if compile_ is not None and compile_.active and getattr(compile_.settings, "regions", None) == "blocks+head":
        return ("compile.regions = 'blocks+head' compiles the stock lm_head and loss; use compile.regions: blocks "
                "with the chunked loss")
    return None


# -------------------------------------------------------------------------------------------- apply
def training_args(decision: Decision, args) -> dict:
    return {}


def apply(decision: Decision, setup, outcome: Outcome) -> None:
    st = decision.settings
    if not st.chunked:
        return
    if setup.model is None:
        _not_applied(outcome, "no model (model_init is not supported)")
        return
    why = unsupported_reason(setup.model)
    if why:
        _not_applied(outcome, why)
        return
    install(setup.model, st.chunk_tokens)
    logger.info("hf_speedup: chunked loss installed on %s (%d tokens per chunk)",
                type(unwrap_model(setup.model)).__name__, st.chunk_tokens)


def attach(decision: Decision, trainer, outcome: Outcome, setup) -> None:
    """The Trainer read ``model_accepts_loss_kwargs`` from the model's signature in its ``__init__``: a head that
    takes its own mean gets what an ``accepts_loss_kwargs = False`` model gets."""
    if decision.settings.own_mean and getattr(trainer, "model_accepts_loss_kwargs", False):
        trainer.model_accepts_loss_kwargs = False
        logger.info("hf_speedup loss: %s", SCALING_OFF)


def _scaling_note(decision: Decision, trainer) -> str:
    if not decision.settings.own_mean:
        return ""
    if getattr(trainer, "model_accepts_loss_kwargs", None) is False:
        return f"; verified: trainer.model_accepts_loss_kwargs = False ({SCALING_OFF.split(' (')[0]})"
    return ("; NOT verified: trainer.model_accepts_loss_kwargs is True again (set after the trainer was built): "
            "the Trainer's token-count scaling applies")


def _not_applied(outcome: Outcome, why: str) -> None:
    logger.warning("hf_speedup loss: chunked loss not applied: %s", why)
    outcome.fallbacks.append(f"chunked: {why}")
    outcome.withdraw(f"not installed: {why}; the stock loss is kept")


# ------------------------------------------------------------------------------------------- verify
def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    engaged, reason = _verify_chunked(decision, trainer, outcome)
    return engaged, reason + _scaling_note(decision, trainer)


def _verify_chunked(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    if not decision.settings.chunked:
        return False, decision.reason
    if outcome.withdrawn:
        return False, f"withdrawn after planning: {outcome.withdrawn}"
    model = trainer.model
    state = installed_state(model)
    if state is None:
        return False, "not installed: " + ("; ".join(outcome.fallbacks) or "the model has the stock loss")
    what = f"chunked loss, {state.chunk_tokens} tokens per chunk"
    ran = state.chunked_calls
    steps = steps_trained(trainer, outcome)
    if steps > 0 and not ran:
        return False, (f"{what} installed, but none of {steps} training steps took it: the trainer computes "
                       "its loss another way (e.g. TRL's fused lm_head, or labels passed positionally)")
    used = f"; {ran} training forward(s) took it" if ran else ""
    ok, why = _can_probe(trainer)
    if not ok:
        return True, f"{what} installed on the live model ({why}){used}"
    try:
        chunked, stock, took_path, logits_none = probe(model, state)
    except Exception as exc:  # the chunked path could not be shown to give the stock loss: not trusted
        uninstall(model)
        first = str(exc).splitlines()[0][:160] if str(exc) else ""
        text = (f"a probe forward with labels failed ({type(exc).__name__}: {first}), so the chunked loss could not "
                "be checked against the stock one: uninstalled, the stock loss is back")
        outcome.fallbacks.append(f"chunked: {text}")
        outcome.withdraw(text)
        logger.warning("hf_speedup loss: %s", text)
        return False, text
    rel = abs(chunked - stock) / max(abs(stock), 1e-12)
    tol = PROBE_REL.get(state.head.weight.dtype, 1e-2)
    outcome.facts["probe_relative_difference"] = rel
    if not took_path or not logits_none:
        return False, f"{what} installed, but a probe forward with labels did not take it"
    if not rel <= tol:
        uninstall(model)
        text = (f"MISMATCH: chunked loss {chunked:.6g} vs stock {stock:.6g} on a probe (relative {rel:.1e} > "
                f"{tol:g}): uninstalled, the stock loss is back")
        outcome.fallbacks.append(f"chunked: {text}")
        outcome.withdraw(text)
        logger.warning("hf_speedup loss: %s", text)
        return False, text
    return True, (f"{what} on the live model: a probe forward with labels took it (logits None) and matched the "
                  f"stock loss ({chunked:.6g} vs {stock:.6g}){used}")


def _can_probe(trainer) -> tuple[bool, str]:
    args = getattr(trainer, "args", None)
    if getattr(args, "world_size", 1) > 1:
        return False, "several processes: checked structurally only"
    if getattr(trainer, "is_deepspeed_enabled", False):
        return False, "DeepSpeed: checked structurally only"
    return True, ""


def probe(model, state, seq_len: int = PROBE_TOKENS) -> tuple[float, float, bool, bool]:
    """(chunked loss, stock loss, the chunked path ran, logits were None) of one tiny forward with labels.

    Training mode (the chunked path is for training), no gradients, same RNG for both forwards, compiled
    code not run (no compile for the probe's shape); modes, RNG and the call counter are restored.
    """
    base = unwrap_model(model)
    emb = base.get_input_embeddings()
    ids = (torch.arange(seq_len, device=emb.weight.device) * 7 % emb.num_embeddings).unsqueeze(0)
    labels = ids.clone()
    labels[:, : seq_len // 4] = IGNORE_INDEX
    calls = state.chunked_calls
    with eager_train_mode(model), torch.no_grad():
        torch.manual_seed(0)
        out = model(input_ids=ids, labels=labels, use_cache=False)
        took_path = state.chunked_calls > calls
        state.enabled = False
        try:
            torch.manual_seed(0)
            stock = model(input_ids=ids, labels=labels, use_cache=False)
        finally:
            state.enabled = True
            state.chunked_calls = calls
    return float(out.loss), float(stock.loss), took_path, getattr(out, "logits", None) is None
