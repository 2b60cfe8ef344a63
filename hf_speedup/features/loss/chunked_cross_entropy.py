"""Causal-LM cross-entropy without the full-vocabulary logits: the mechanism behind the ``loss`` feature.

Stock transformers computes ``logits = lm_head(hidden)`` for every token (``tokens x vocab`` floats,
upcast to fp32 for the loss) and keeps them, their log-softmax and later their gradient alive at
once. With SmolLM2's 49,152-token vocabulary and 8 x 512 tokens that is 0.8 GB per copy in fp32.

Here the loss is a sum over chunks of ``chunk_tokens`` tokens. Forward keeps only the per-token
log-sum-exp; backward recomputes each chunk's logits from the saved hidden states (one extra lm_head
matmul per chunk), turns them into ``softmax - onehot`` in place and accumulates the hidden-state and
weight gradients. Measured on 4096 x 576 -> 49,152 (CPU, fp32): a custom autograd Function with
1024-token chunks is 1.1x the stock head + loss time; ``torch.utils.checkpoint`` per chunk 1.3x (it
lets autograd materialise a full weight gradient per chunk).

The math is transformers' ``ForCausalLMLoss`` exactly: labels shifted by padding with
``ignore_index``, fp32 logits, sum divided by ``num_items_in_batch`` when the Trainer passes it
(gradient accumulation), else the mean over non-ignored tokens. Ignored tokens (padding, masked
prompts) are dropped before the head, so they cost nothing; finding them is a host sync on CUDA.

:func:`install` wires it into a transformers model without touching the Trainer loop: in training mode,
when ``labels`` are given, the model's own forward runs with the lm_head passing the hidden states
through and the model's ``loss_function`` computing the chunked loss from them; the output then has
no ``logits`` (``None``). In eval mode or without labels the stock path runs unchanged.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import MethodType

import torch
import torch.nn.functional as F
from torch import nn

from ...blocks import unwrap_model

IGNORE_INDEX = -100
STATE_ATTR = "_hf_speedup_chunked_loss"  # on the transformers model: the installed ChunkedLossState
DEFER_ATTR = "_hf_speedup_defer_head"  # on the lm_head: pass hidden states through for this forward
# Config attributes of models that change the logits between lm_head and the loss (softcapping,
# scaling): the loss would see the hidden states transformed, so those models keep the stock loss.
LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_softcapping", "logits_scaling", "logit_scale")


# ------------------------------------------------------------------------------------------- the math
class _LinearCrossEntropySum(torch.autograd.Function):
    """``sum_i CE(hidden_i @ weight.T + bias, target_i)`` over rows that are all valid targets."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_tokens: int):
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk_tokens):
            end = min(start + chunk_tokens, n)
            logits = _logits(hidden[start:end], weight, bias)
            target_logit = logits.gather(1, targets[start:end, None]).squeeze(1)
            chunk_lse = _logsumexp_(logits)
            lse[start:end] = chunk_lse
            total += (chunk_lse - target_logit).sum()
            del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_tokens = chunk_tokens
        return total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_total):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight) if need_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_bias else None
        n, c = hidden.shape[0], ctx.chunk_tokens
        for start in range(0, n, c):
            end = min(start + c, n)
            h = hidden[start:end]
            # softmax - onehot, scaled by the incoming gradient: d(sum CE)/d(logits), built in place
            g = _logits(h, weight, bias).sub_(lse[start:end, None]).exp_()
            g[torch.arange(end - start, device=g.device), targets[start:end]] -= 1.0
            g.mul_(grad_total)
            if need_bias:
                grad_bias += g.sum(0)
            g = g.to(hidden.dtype)
            if need_hidden:
                torch.mm(g, weight, out=grad_hidden[start:end])
            if need_weight:
                grad_weight.addmm_(g.t(), h)
            del g
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None


def _logsumexp_(logits):
    """``torch.logsumexp(logits, -1)`` step for step (max, the same inf guard, exp, sum, log, + max), but in the logits'
    own storage: the kernel's ``logits - max`` is a second chunk-sized fp32 tensor (4 bytes x chunk x vocabulary, 0.5
    GB for 1024 tokens of Llama 3's vocabulary), allocated inside it, where only the device's allocator sees it."""
    maxes = logits.amax(dim=-1, keepdim=True)
    maxes.masked_fill_(maxes.abs() == float("inf"), 0)
    return logits.sub_(maxes).exp_().sum(dim=-1).log_().add_(maxes.squeeze(-1))


def _logits(hidden, weight, bias):
    """One chunk's logits in fp32 (computed in the input dtype, upcast as transformers does)."""
    return F.linear(hidden, weight, bias).float()


def linear_cross_entropy_sum(hidden, weight, bias, targets, chunk_tokens: int):
    """Summed cross-entropy of ``hidden @ weight.T (+ bias)`` over ``targets`` (all valid), in chunks.

    Under autocast the inputs are cast to the autocast dtype first, as ``nn.Linear`` would be.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropySum.apply(hidden, weight, bias, targets, int(chunk_tokens))


def chunked_causal_lm_loss(hidden_states, weight, bias, labels, *, num_items_in_batch=None,
                           ignore_index: int = IGNORE_INDEX, shift_labels=None, chunk_tokens: int = 1024):
    """transformers' ``ForCausalLMLoss(lm_head(hidden_states), labels, ...)`` without the full logits."""
    if shift_labels is None:
        labels = F.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    targets = shift_labels.reshape(-1).to(hidden.device)
    keep = (targets != ignore_index).nonzero().squeeze(1)
    total = linear_cross_entropy_sum(hidden.index_select(0, keep), weight, bias, targets.index_select(0, keep),
                                     chunk_tokens)
    count = keep.numel()
    if num_items_in_batch is None:
        return total / count  # the mean over valid tokens; NaN when there is none, as in transformers
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


# ------------------------------------------------------------------------------------ wiring into a model
@dataclass
class ChunkedLossState:
    """What :func:`install` put on a model (kept on it as ``_hf_speedup_chunked_loss``)."""

    head: nn.Module
    stock_loss: object  # the loss function the model had (called when not chunking)
    had_own_loss: bool  # the model had an instance-level ``_loss_function`` before
    chunk_tokens: int
    enabled: bool = True
    chunked_calls: int = 0  # forwards that took the chunked path (engagement evidence)


class ChunkedLoss:
    """The model's ``loss_function`` while installed: chunked when the head deferred, stock otherwise."""

    def __init__(self, state: ChunkedLossState):
        self.state = state

    def __call__(self, logits, labels, vocab_size=None, **kwargs):
        state = self.state
        if not getattr(state.head, DEFER_ATTR, False):
            return state.stock_loss(logits, labels, vocab_size, **kwargs)
        state.chunked_calls += 1
        head = state.head
        return chunked_causal_lm_loss(
            logits, head.weight, head.bias, labels, num_items_in_batch=kwargs.get("num_items_in_batch"),
            ignore_index=kwargs.get("ignore_index", IGNORE_INDEX), shift_labels=kwargs.get("shift_labels"),
            chunk_tokens=state.chunk_tokens)


def unsupported_reason(model) -> str | None:
    """Why the chunked loss cannot be wired into ``model`` (None when it can)."""
    base = unwrap_model(model)
    if not hasattr(type(base), "loss_function") or not hasattr(base, "get_output_embeddings"):
        return f"{type(base).__name__} is not a transformers model with a loss_function"
    head = base.get_output_embeddings()
    if type(head) is not nn.Linear:
        return (f"the output head is {type(head).__name__ if head is not None else 'missing'}, not a plain "
                "nn.Linear (e.g. LoRA on lm_head, a quantized head)")
    config = getattr(base, "config", None)
    post = [a for a in LOGIT_POSTPROCESSING if getattr(config, a, None) not in (None, 1, 1.0)]
    if post:
        return f"{type(base).__name__} post-processes its logits ({', '.join(post)}); the stock loss is kept"
    for name, module in (("model", base), ("lm_head", head)):
        if "forward" in vars(module) and not getattr(vars(module)["forward"], "_hf_speedup", False):
            return f"the {name}'s forward is already replaced on the instance by something else"
    return None


def installed_state(model) -> ChunkedLossState | None:
    return getattr(unwrap_model(model), STATE_ATTR, None)


def install(model, chunk_tokens: int) -> ChunkedLossState:
    """Wire the chunked loss into ``model`` (idempotent); :func:`unsupported_reason` must be None."""
    base = unwrap_model(model)
    state = installed_state(base)
    if state is not None:
        state.chunk_tokens, state.enabled = chunk_tokens, True
        return state
    head = base.get_output_embeddings()
    own = "_loss_function" in vars(base)
    state = ChunkedLossState(head=head, stock_loss=base.loss_function, had_own_loss=own, chunk_tokens=chunk_tokens)
    setattr(head, DEFER_ATTR, False)
    head.forward = MethodType(_deferred_head_forward, head)
    base.loss_function = ChunkedLoss(state)
    base.forward = MethodType(_chunking_forward(type(base).forward), base)
    object.__setattr__(base, STATE_ATTR, state)
    return state


def uninstall(model) -> bool:
    """Put the stock forward, head and loss back; False when nothing was installed."""
    base = unwrap_model(model)
    state = installed_state(base)
    if state is None:
        return False
    for module in (base, state.head):
        if _installed_forward(module):  # another library may have wrapped it since (TRL's fused lm_head): keep that
            vars(module).pop("forward", None)
    vars(state.head).pop(DEFER_ATTR, None)
    if state.had_own_loss:
        base.loss_function = state.stock_loss
    else:
        vars(base).pop("_loss_function", None)
    vars(base).pop(STATE_ATTR, None)
    return True


def _installed_forward(module) -> bool:
    func = getattr(vars(module).get("forward"), "__func__", None)
    return func is _deferred_head_forward or getattr(func, "hf_speedup_chunked", False)


def _deferred_head_forward(self, hidden_states):
    if getattr(self, DEFER_ATTR, False):
        return hidden_states  # the loss function applies the weight chunk by chunk
    return type(self).forward(self, hidden_states)


_deferred_head_forward._hf_speedup = True


def _chunking_forward(stock_forward):
    """The model's forward, chunking the loss when training with ``labels`` (keyword) given."""

    @functools.wraps(stock_forward)  # the Trainer reads the signature (loss kwargs such as num_items_in_batch)
    def forward(self, *args, **kwargs):
        state = getattr(self, STATE_ATTR, None)
        if state is None or not state.enabled or not self.training or kwargs.get("labels") is None:
            return stock_forward(self, *args, **kwargs)
        setattr(state.head, DEFER_ATTR, True)
        try:
            out = stock_forward(self, *args, **kwargs)
        finally:
            setattr(state.head, DEFER_ATTR, False)
        return _without_logits(out)

    forward._hf_speedup = True
    forward.hf_speedup_chunked = True  # uninstall removes only what install put there
    return forward


def _without_logits(out):
    """The output with ``logits`` None (they were never computed; the field held the hidden states)."""
    if isinstance(out, tuple):
        return (out[0], None, *out[2:])
    if "logits" in out:
        return type(out)(**{k: v for k, v in out.items() if k != "logits"})
    return out
