"""Tokens and sequences of a batch, counted on the device: the throughput figures' numerator and the ``S`` of
the FLOPs formula, summed over ranks at a logging step (the one point where reading them costs no extra sync)."""

from __future__ import annotations

from typing import Any, Sequence

IGNORE_INDEX = -100

COUNTS = ("tokens", "samples", "attended_tokens", "attended_squares")


def _get(batch, key):
    return batch.get(key) if hasattr(batch, "get") else None


def _segment_ends(position_ids):
    """Where each sequence of a padding-free row ends (bool, same shape), padding left out.

    A sequence restarts at ``position_ids == 0``; after the last non-zero position only zeros follow, which is
    how a padded padding-free row (TRL's ``pad_to_multiple_of``) pads: those are not sequences. A real final
    sequence of one token is counted as padding too: it has no target and next to no work.
    """
    import torch

    length = position_ids.shape[-1]
    index = torch.arange(length, device=position_ids.device)
    last = torch.where(position_ids != 0, index, -1).amax(-1, keepdim=True)
    last = torch.where(last < 0, length - 1, last)  # only one-token sequences: all of them real
    next_starts = torch.ones_like(position_ids, dtype=torch.bool)
    next_starts[..., :-1] = position_ids[..., 1:] == 0
    return (index <= last) & (next_starts | (index == last))


def batch_counts(batch: dict) -> Any:
    """(tokens, sequences, attended tokens, sum of squared sequence lengths) of one (micro-)batch of this rank,
    a 4-element int64 tensor on the batch's device: no ``.item()``, no boolean indexing, so no sync.

    Tokens are the work: ``attention_mask == 1`` (2-D masks); else the sequences of a padding-free row
    (``position_ids`` restarting at 0, padding after the last sequence left out); else ``labels != -100``;
    else every input id. Sequence lengths are what attention spans: each sequence of a padding-free row on
    its own, else the non-padding length of each row; their squares give attention's FLOPs.
    """
    import torch

    mask, ids, labels = _get(batch, "attention_mask"), _get(batch, "input_ids"), _get(batch, "labels")
    positions = _get(batch, "position_ids")
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        lengths = (mask != 0).sum(-1, dtype=torch.int64)
        return torch.stack([lengths.sum(), (lengths > 0).sum(), lengths.sum(), (lengths * lengths).sum()])
    if isinstance(positions, torch.Tensor) and positions.dim() == 2 and isinstance(ids, torch.Tensor):
        ends = _segment_ends(positions)
        lengths = (positions.to(torch.int64) + 1) * ends
        return torch.stack([lengths.sum(), ends.sum(), lengths.sum(), (lengths * lengths).sum()])
    rows = next((t for t in (ids, labels, _get(batch, "inputs_embeds")) if isinstance(t, torch.Tensor)
                 and t.dim() >= 2), None)
    if rows is None:
        return torch.zeros(4, dtype=torch.int64)
    n, length = rows.shape[0], rows.shape[1]
    tokens = torch.count_nonzero(labels != IGNORE_INDEX) if isinstance(labels, torch.Tensor) else \
        torch.tensor(n * length, device=rows.device)
    sizes = torch.tensor([n, n * length, n * length * length], dtype=torch.int64, device=rows.device)
    return torch.cat([tokens.reshape(1).to(torch.int64), sizes])


class TokenCounter:
    """Running ``COUNTS`` of this rank.

    Each micro-batch's counts stay a small device tensor in a pending list (a few reduction kernels per
    micro-batch, no sync); the list is folded into the total only when someone reads it.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._total = None  # 4-element int64 tensor
        self._pending: list = []

    def add(self, batch: dict) -> None:
        self._pending.append(batch_counts(batch))

    def totals_tensor(self, device=None):
        """The ``COUNTS`` totals as one int64 tensor (on ``device`` if given); reading it is the caller's sync."""
        import torch

        if self._pending:
            dev = self._total.device if self._total is not None else self._pending[0].device
            parts = [p.to(dev, dtype=torch.int64) for p in self._pending]
            if self._total is not None:
                parts.append(self._total)
            self._total = torch.stack(parts).sum(0)
            self._pending = []
        if self._total is None:
            return torch.zeros(len(COUNTS), dtype=torch.int64, device=device)
        return self._total if device is None else self._total.to(device)

    def tokens_tensor(self, device=None):
        return self.totals_tensor(device)[0]

    @property
    def samples(self) -> int:
        return int(self.totals_tensor()[1])


# Per-rank vector exchanged at logging steps: one small gather, summed or maxed per field.
RANK_FIELDS = COUNTS + ("peak_memory_allocated_bytes", "peak_memory_reserved_bytes", "memory_allocated_bytes")
_SUMMED = set(COUNTS)


def aggregate_ranks(rows: Sequence[Sequence[float]]) -> dict:
    """Combine per-rank vectors (``RANK_FIELDS`` order): the counts are summed over ranks, memory is the
    maximum (the rank that needs the most decides whether a run fits)."""
    if not rows:
        return {k: 0 for k in RANK_FIELDS}
    out = {}
    for i, key in enumerate(RANK_FIELDS):
        col = [int(r[i]) for r in rows]
        out[key] = sum(col) if key in _SUMMED else max(col)
    return out


def attention_length(attended_tokens: int, attended_squares: int) -> float | None:
    """``S`` of the FLOPs formula: the token-weighted mean sequence length, sum(L_i^2) / sum(L_i). Each token
    attends over its own sequence, so a batch of lengths 100 and 10 costs what lengths of ~91 would, not 55,
    and a padding-free row of 8 sequences costs what they cost apart, not what one row of their total would."""
    return attended_squares / attended_tokens if attended_tokens else None
