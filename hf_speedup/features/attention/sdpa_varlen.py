"""``sdpa_varlen``: causal attention over padding-free rows, one sequence at a time, on CPU.

Why: a padding-free row holds several sequences back to back. transformers' ``sdpa`` separates them with a
block-diagonal ``T x T`` mask, so the kernel still computes every cross-sequence block and then masks it
out (for 8 sequences of log-uniform 16-512 tokens that is about 4x the attention work that is needed), and
the mask itself is built every step. The flash-attention kernels avoid that with ``cu_seqlens``, but they
need CUDA. Here each sequence is handed to torch's own CPU flash-attention kernel
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward) with ``is_causal=True``: the same
math as the masked call (checked in the tests), without the wasted blocks. Grouped-query models hand their
key/value heads over as they are (the kernel shares them across query heads itself, :func:`native_gqa`), so no
per-head copy of the keys and values is made or kept for backward.

The sequence boundaries come from ``position_ids`` (a restart marks a new sequence, the rule transformers
itself uses in ``find_packed_sequence_indices``). The per-sequence loop runs inside one custom op
(``hf_speedup::sdpa_varlen``), so ``torch.compile`` sees a single opaque call with a fixed output shape: no
graph break, no data-dependent shapes, and a changing number of sequences never recompiles.

It is registered with transformers' ``AttentionInterface`` (the attention call) and
``AttentionMaskInterface`` (no ``T x T`` mask is built when there is no padding), so a model runs it through
``model.set_attn_implementation("sdpa_varlen")`` like any built-in kernel. Calls it cannot serve (a padding
mask, decoding with a cache, dropout, non-causal attention, another device) go to transformers' ``sdpa``,
with a block-diagonal mask made from ``position_ids`` where the row is packed, so every path stays exact.
"""

from __future__ import annotations

import logging

import torch

NAME = "sdpa_varlen"
logger = logging.getLogger("hf_speedup")
_WARNED: dict[str, bool] = {}
_aten = torch.ops.aten


# --------------------------------------------------------------------------------------- boundaries
def sequence_bounds(position_ids: torch.Tensor) -> list[list[int]]:
    """Per row, the start of every sequence plus the row's end: ``[[0, 5, 12, 20], ...]``."""
    rows = position_ids.reshape(-1, position_ids.shape[-1])
    first = rows[:, :1] + 1  # never one below the first position: a row always starts a sequence
    starts = torch.diff(rows, prepend=first, dim=-1) != 1
    out = []
    for row in starts:
        idx = torch.nonzero(row).reshape(-1).tolist()
        out.append(idx + [rows.shape[-1]])
    return out


def _segments(position_ids: torch.Tensor, batch: int):
    """(row slice, start, end) for every sequence of a (batch, heads, T, dim) tensor."""
    bounds = sequence_bounds(position_ids)
    if len(bounds) == 1:  # one set of boundaries shared by every row
        return [(slice(None), s, e) for s, e in zip(bounds[0][:-1], bounds[0][1:])]
    if len(bounds) != batch:
        raise ValueError(f"position_ids has {len(bounds)} rows for a batch of {batch}")
    return [(slice(b, b + 1), s, e) for b, row in enumerate(bounds) for s, e in zip(row[:-1], row[1:])]


# --------------------------------------------------------------------------------------- the op
@torch.library.custom_op("hf_speedup::sdpa_varlen", mutates_args=())
def sdpa_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position_ids: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of every sequence with itself; (output, logsumexp) shaped like torch's CPU kernel."""
    out = torch.empty_like(query)
    lse = query.new_empty(query.shape[:3], dtype=torch.float32)
    for rows, s, e in _segments(position_ids, query.shape[0]):
        o, l = _aten._scaled_dot_product_flash_attention_for_cpu(
            query[rows, :, s:e], key[rows, :, s:e], value[rows, :, s:e], 0.0, True, attn_mask=None, scale=scale)
        out[rows, :, s:e] = o
        lse[rows, :, s:e] = l
    return out, lse


@sdpa_varlen.register_fake
def _(query, key, value, position_ids, scale):
    return torch.empty_like(query), query.new_empty(query.shape[:3], dtype=torch.float32)


@torch.library.custom_op("hf_speedup::sdpa_varlen_backward", mutates_args=())
def sdpa_varlen_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, position_ids: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = query.shape[1] // key.shape[1]
    grouped_key, grouped_value = key, value
    if groups > 1:  # the kernel's grouped backward measured ~12% slower than repeating here and summing after
        from transformers.integrations.sdpa_attention import repeat_kv

        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    for rows, s, e in _segments(position_ids, query.shape[0]):
        gq, gk, gv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad[rows, :, s:e], query[rows, :, s:e], key[rows, :, s:e], value[rows, :, s:e], out[rows, :, s:e],
            lse[rows, :, s:e], 0.0, True, attn_mask=None, scale=scale)
        dq[rows, :, s:e] = gq
        dk[rows, :, s:e] = gk
        dv[rows, :, s:e] = gv
    if groups > 1:  # each key/value head's gradient: the sum over the query heads that shared it, laid out like
        # the key/value it is for (the fake's empty_like: inductor holds the op to that layout)
        dk = torch.empty_like(grouped_key).copy_(_sum_heads(dk, groups))
        dv = torch.empty_like(grouped_value).copy_(_sum_heads(dv, groups))
    return dq, dk, dv


def _sum_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    """The inverse of transformers' repeat_kv for gradients: query head h used key/value head h // groups."""
    b, h, t, d = x.shape
    return x.view(b, h // groups, groups, t, d).sum(2)


@sdpa_varlen_backward.register_fake
def _(grad, query, key, value, out, lse, position_ids, scale):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    query, key, value, position_ids, scale = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, position_ids)
    ctx.scale = scale


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, position_ids = ctx.saved_tensors
    if grad_out.stride(-1) != 1 or 0 in grad_out.stride():  # the kernel reads any other strides as they are
        grad_out = grad_out.contiguous()
    dq, dk, dv = torch.ops.hf_speedup.sdpa_varlen_backward(grad_out, query, key, value, out, lse, position_ids,
                                                           ctx.scale)
    return dq, dk, dv, None, None


sdpa_varlen.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------- transformers glue
_GQA: dict[str, bool] = {}


def native_gqa() -> bool:
    """torch's CPU flash kernel takes fewer key/value heads than query heads: then the forward reads them as they
    are and only they are kept for backward (repeated per query head they were a copy of each per layer, kept until
    the backward); the backward repeats them for its own call, which runs faster than the grouped one."""
    if "cpu" not in _GQA:
        generator = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, 3, 8, generator=generator) for h in (4, 2, 2))
        try:
            o, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, attn_mask=None, scale=1.0)
            want = torch.nn.functional.scaled_dot_product_attention(  # query head h reads key/value head h // 2
                q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1), is_causal=True, scale=1.0)
            ok = o.shape == q.shape and torch.allclose(o, want, atol=1e-5)
        except (RuntimeError, ValueError):  # an older kernel that wants equal head counts
            ok = False
        _GQA["cpu"] = ok
    return _GQA["cpu"]


def packed_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) bool: causal within each sequence of a packed row (the mask transformers' sdpa would use)."""
    rows = position_ids.reshape(-1, position_ids.shape[-1])
    seq = (torch.diff(rows, prepend=rows[:, :1] + 1, dim=-1) != 1).cumsum(-1)
    t = rows.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=rows.device).tril()
    return ((seq[:, :, None] == seq[:, None, :]) & causal)[:, None]


def _one_head_size(module, query, value) -> bool:
    """torch's CPU flash kernel needs values as wide as queries (the plan keeps latent-attention models off this
    kernel; a model switched to it by hand goes through sdpa, said once)."""
    if query.shape[-1] == value.shape[-1]:
        return True
    if not _WARNED.get("head_size"):
        _WARNED["head_size"] = True
        logger.warning("hf_speedup attention fallback: %s has %d-wide values under %d-wide queries; sdpa_varlen runs "
                       "it through sdpa with a block-diagonal mask", type(module).__name__, value.shape[-1],
                       query.shape[-1])
    return False


def _varlen(query, key, value, position_ids, scale: float) -> torch.Tensor:
    out, _ = torch.ops.hf_speedup.sdpa_varlen(query, key, value, position_ids, float(scale))
    return out


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention signature; (B, T, H, D) output like ``sdpa_attention_forward``."""
    return attention_call(NAME, _varlen, module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                          is_causal=is_causal, grouped=native_gqa(), dtypes=None, **kwargs)


def attention_call(name: str, run, module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                   is_causal=None, grouped: bool = False, dtypes=None, **kwargs):
    """A per-sequence causal kernel ``run(q, k, v, position_ids, scale) -> (B, H, T, D)`` behind transformers'
    attention call: the calls it cannot serve (a padding mask, decoding with a cache, dropout, non-causal, another
    device, a dtype outside ``dtypes``) go to sdpa with a block-diagonal mask where the row is packed."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if kwargs.get("softcap") is not None:  # as transformers' sdpa: the cap would be silently left out
        raise ValueError(f"attention {name}: {type(module).__name__} caps its attention logits (softcap), which "
                         "this kernel cannot apply; fix: set attention.implementation: eager")
    position_ids = kwargs.get("position_ids")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    q_len = query.shape[2]
    eligible = (attention_mask is None and causal and not dropout and q_len == key.shape[2] and q_len > 1
                and query.device.type == "cpu")
    if eligible and position_ids is None:
        raise RuntimeError(
            f"attention {name}: {type(module).__name__} did not pass position_ids to its attention call, so "
            "the sequences of a padding-free row cannot be told apart; fix: set attention.implementation: sdpa")
    dtype = torch.get_autocast_dtype(query.device.type) if torch.is_autocast_enabled(query.device.type) \
        else value.dtype
    if eligible and dtypes is not None and dtype not in dtypes:
        eligible = False
        if not _WARNED.get(f"dtype-{name}"):
            _WARNED[f"dtype-{name}"] = True
            logger.warning("hf_speedup attention fallback: %s computes in %s, not %s; its calls go through sdpa",
                           name, ", ".join(str(d) for d in dtypes), dtype)
    if not (eligible and _one_head_size(module, query, value)):
        if attention_mask is None and causal and position_ids is not None and q_len == key.shape[2] and q_len > 1:
            attention_mask = packed_causal_mask(position_ids)  # exact for packed rows, plain causal otherwise
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    if torch.is_autocast_enabled(query.device.type):  # what autocast does for sdpa (RoPE leaves q, k in fp32)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    elif not query.dtype == key.dtype == value.dtype:
        query, key = query.to(value.dtype), key.to(value.dtype)
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1 and not grouped:
        key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = run(query, key, value, position_ids, float(scale))
    return out.transpose(1, 2).contiguous(), None


def mask_function(*args, **kwargs):
    """No mask where the attention separates sequences itself (no padding, no cache offset); else sdpa's."""
    from transformers.masking_utils import sdpa_mask

    if (kwargs.get("attention_mask") is None and kwargs.get("q_length") == kwargs.get("kv_length")
            and not kwargs.get("q_offset") and not kwargs.get("kv_offset")):
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> str:
    """Make ``sdpa_varlen`` a transformers attention implementation (idempotent); returns its name. Probes the
    kernel's grouped heads here, outside any trace (the probe's tensor checks would break a fullgraph compile)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    native_gqa()

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_function)
    return NAME
