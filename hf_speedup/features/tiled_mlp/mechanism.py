"""How one block's MLP runs over tiles of the sequence, and how to read that back from the module.

Each tile runs under non-reentrant checkpointing: its intermediates (gate, up, their product: tokens x the MLP
width, several times) are freed as soon as the tile's output exists, and recomputed one tile at a time in
backward. Inside a checkpointed block the block's own recompute runs the tiles checkpointed again (torch nests
non-reentrant checkpoints), so the MLP's intermediates never exist for the whole sequence, forward or backward.

Why this tiler works under DDP, FSDP2 and DeepSpeed where per-tile ``backward()`` tilers do not: every tile reads
the same weight tensors, so autograd sums their gradients in the one ``AccumulateGrad`` node each weight has,
which runs once per backward. The engines' gradient hooks (DDP's reducer, FSDP2's reduce-scatter, ZeRO's
bucketing) hang on that node: they fire once per step, not once per tile.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..probe import probing

MLP_NAMES = ("mlp", "feed_forward", "ffn")  # what transformers names a block's MLP (Llama, Llama 4, others)


@dataclass(frozen=True)
class TileRule:
    """How many tiles a sequence of ``n`` tokens is cut into: ``fixed_tiles`` whatever the length, else
    ``tile_tokens`` per tile where fixed, else ``n // min_tile_tokens`` tiles, at most ``max_tiles`` (then each
    tile is ``n / tiles`` tokens)."""

    tile_tokens: int | None = None  # fixed tokens per tile (tiled_mlp.tile_tokens)
    min_tile_tokens: int = 1024
    max_tiles: int = 1
    # the same count at every length (ZeRO-3 gathers the MLP's weights at every tile: every rank must run as many)
    fixed_tiles: int | None = None

    def tiles(self, n: int) -> int:
        if self.fixed_tiles is not None:
            return self.fixed_tiles
        if n <= 0:
            return 1
        if self.tile_tokens is not None:
            return -(-n // self.tile_tokens)
        return max(1, min(self.max_tiles, n // self.min_tile_tokens))

    def tile_length(self, n: int) -> int:
        """The longest tile at ``n`` tokens (what one tile's intermediates are sized by)."""
        return -(-n // self.tiles(n))

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = x.shape[-2]
        if self.tile_tokens is not None and self.fixed_tiles is None:
            return x.split(self.tile_tokens, dim=-2)
        return x.tensor_split(self.tiles(n), dim=-2)


@dataclass
class TileRecord:
    """What the tiled MLP saw, counted where the tiles run (not computed from the rule): the recorder that
    verification reads."""

    calls: int = 0  # tiled forwards (a checkpointed block's recompute counts again)
    tokens: int = 0  # sequence length of the last call
    tiles: int = 0  # tiles that really ran in the last call
    expected: int = 0  # what the rule planned for that length
    mismatched: int = 0  # calls whose tiles run differed from the rule's
    probe_tiles: int = 0  # tiles run by the last verification probe (probes are not training)


def mlp_of(block: nn.Module) -> tuple[str, nn.Module] | tuple[None, None]:
    """The block's dense MLP (name, module), or (None, None): a block without one, or a mixture of experts
    (its router's outputs are recorded per call for the auxiliary loss: tiles would split them)."""
    for name in MLP_NAMES:
        mlp = getattr(block, name, None)
        if isinstance(mlp, nn.Module) and _one_tensor_forward(mlp) and not is_moe(mlp):
            return name, mlp
    return None, None


def is_moe(module: nn.Module) -> bool:
    """Routed experts inside: fused 3-D expert weights, an ``experts`` child or a router."""
    for name, m in module.named_modules():
        cls = type(m).__name__
        if name.split(".")[-1] == "experts" or "Router" in cls or "Experts" in cls or "SparseMoe" in cls:
            return True
        if any(p.dim() == 3 for p in m.parameters(recurse=False)):
            return True
    return False


def _one_tensor_forward(mlp: nn.Module) -> bool:
    """A forward that takes the hidden states alone (per-token work: tiling over the sequence is exact)."""
    forward = getattr(mlp.forward, "_hf_speedup_inner", mlp.forward)
    try:
        params = [p for p in inspect.signature(forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        return False
    return len(params) == 1


class _Keep(torch.autograd.Function):
    """Identity that saves the MLP's input for the tiles' recompute. Saved this way (not held by the tiles'
    checkpoints), a checkpointed block drops it after the forward and recomputes it on demand, stopping right
    there (the MLP is not run again for it): the block keeps only its own input between forward and backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def tile_mlp(mlp: nn.Module, rule: TileRule) -> TileRecord:
    """Make ``mlp`` run tiled while gradients are recorded (training); idempotent (a second call sets the rule)."""
    if getattr(mlp.forward, "_hf_speedup_tiled", False):
        mlp.forward._hf_speedup_rule[0] = rule
        return mlp.forward._hf_speedup_record
    inner = mlp.forward
    own = "forward" in vars(mlp)  # a forward set on the instance (another wrapper): restored as it was
    record = TileRecord()
    rule_box = [rule]
    ran = [0]

    @functools.wraps(inner)
    def forward(x, *args, **kwargs):
        if args or kwargs or not torch.is_grad_enabled() or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return inner(x, *args, **kwargs)
        rule_now = rule_box[0]
        n = x.shape[-2]
        bounds = _bounds([c.shape[-2] for c in rule_now.split(x)])
        before = ran[0]
        if len(bounds) == 1 and rule_now.fixed_tiles is None:
            ran[0] += 1
            out = inner(x)
        else:
            out = torch.cat(_run_tiles(inner, x, bounds, ran), dim=-2)
        done = ran[0] - before
        if probing():
            record.probe_tiles = done
            return out
        expected = rule_now.tiles(n)
        record.calls += 1
        record.tokens, record.tiles, record.expected = n, done, expected
        record.mismatched += int(done != expected)
        return out

    forward._hf_speedup_tiled = True
    forward._hf_speedup_inner = inner
    forward._hf_speedup_own = own
    forward._hf_speedup_rule = rule_box
    forward._hf_speedup_record = record
    mlp.forward = forward
    return record


def _bounds(lengths: list[int]) -> list[tuple[int, int]]:
    out, start = [], 0
    for n in lengths:
        out.append((start, n))
        start += n
    return out


def _run_tiles(inner, x: torch.Tensor, bounds: list[tuple[int, int]], ran: list[int]) -> list[torch.Tensor]:
    """Each tile under its own checkpoint. The tiles read the input from a holder emptied when the forward is done;
    in backward the first tile recomputed unpacks the saved input of :class:`_Keep` (which a checkpointed block
    recomputes on demand; a saved tensor unpacks once) and the holder keeps it until the last tile is recomputed:
    no tile's checkpoint holds the input between forward and backward."""
    kept = _Keep.apply(x) if x.requires_grad else x
    node = kept.grad_fn if x.requires_grad else None
    held = {"x": kept, "recomputed": 0}

    def tile(start: int, length: int):
        ran[0] += 1
        source = held["x"]
        if source is None:  # backward: the tiles' recomputes
            source = held["x"] = node.saved_tensors[0]
            held["recomputed"] = 0
        out = inner(source.narrow(-2, start, length))
        if held.get("forward_done"):
            held["recomputed"] += 1
            if held["recomputed"] == len(bounds):
                held["x"] = None
        return out

    try:
        return [checkpoint(tile, start, length, use_reentrant=False) for start, length in bounds]
    finally:
        if node is not None:
            held["x"], held["forward_done"] = None, True


def untile_mlp(mlp: nn.Module) -> None:
    """The MLP's own forward back."""
    forward = mlp.forward
    if getattr(forward, "_hf_speedup_tiled", False):
        if forward._hf_speedup_own:
            mlp.forward = forward._hf_speedup_inner
        else:
            del mlp.forward  # the instance attribute: the class's forward is back


def tile_record(mlp: nn.Module) -> TileRecord | None:
    """The recorder of a tiled MLP (None where it is not tiled)."""
    return getattr(mlp.forward, "_hf_speedup_record", None)


def tile_rule(mlp: nn.Module) -> TileRule | None:
    box = getattr(mlp.forward, "_hf_speedup_rule", None)
    return box[0] if box else None
