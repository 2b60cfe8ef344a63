"""Sequence-tiled MLP: each block's MLP runs over tiles of the sequence, each tile recomputed in backward, so the
MLP's intermediates (tokens x the MLP width, several tensors: the largest part of a block's working set) never
exist for the whole sequence. With every block checkpointed (the ``long`` preset) what a block holds between
forward and backward stays its input alone, and its recompute holds one tile of the MLP.

How many tiles (``tiled_mlp.tile_tokens``): a fixed number of tokens per tile, or ``auto``: tiles of at least
``MIN_TILE_TOKENS`` tokens (the GEMMs stay large), as many as make one tile's MLP working set (``WORKING_SET``
tensors of the MLP width) no larger than one hidden-state tensor of the whole sequence: ``ceil(6 i / h)`` tiles
at most. The count follows the length of each batch at run time; the plan states it at the planned length
(``memory.seq_len`` or the arguments' ``max_length``).

Exact: the MLP is per token, so the tiles' outputs are the untiled one's; the weights' gradients are summed by
autograd into one accumulation per step, which is why DDP, FSDP2 and DeepSpeed reduce them once (see
:mod:`.mechanism`). Mixtures of experts keep their experts untiled (their routers' outputs are recorded per
call for the auxiliary loss); their dense blocks are tiled. Blocks without a dense MLP taking the hidden states
alone (BERT's split intermediate/output) are not tiled, and the report says which.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ...blocks import find_blocks
from ...memory_model import fmt_bytes
from ...plan_types import OFF, Decision, Outcome, PlanContext
from ..deepspeed import zero_stage
from ..probe import eager_train_mode
from .mechanism import TileRule, mlp_of, tile_mlp, tile_record, tile_rule

NAME = "tiled_mlp"
APPLIES_TO = "model"
logger = logging.getLogger("hf_speedup")

MIN_TILE_TOKENS = 1024  # below this a tile's GEMMs get small enough to cost throughput
WORKING_SET = 6  # MLP-wide tensors per token in a tile's backward: gate, up, act(gate), product, two gradients


@dataclass(frozen=True)
class Settings:
    tile_tokens: int | None = None  # tokens per tile at the planned length (fixed: tiled_mlp.tile_tokens)
    fixed: bool = False  # tile_tokens is the user's fixed tile; otherwise the auto rule below
    min_tile_tokens: int = MIN_TILE_TOKENS
    max_tiles: int = 1
    seq_len: int | None = None  # the planned length the figures are for
    tiles: int | None = None  # tiles at that length
    same_count: bool = False  # every batch in ``tiles`` tiles whatever its length (ZeRO-3: ranks call alike)

    @property
    def rule(self) -> TileRule:
        if self.same_count:
            return TileRule(fixed_tiles=self.tiles)
        if self.fixed:
            return TileRule(tile_tokens=self.tile_tokens)
        return TileRule(min_tile_tokens=self.min_tile_tokens, max_tiles=self.max_tiles)


def tile_tokens_at(settings: Settings, tokens: int) -> int:
    """The longest tile at ``tokens`` tokens (what the memory model sizes one tile's intermediates by)."""
    return settings.rule.tile_length(tokens)


# ----------------------------------------------------------------------------------------- decide
def _planned_length(ctx: PlanContext) -> tuple[int | None, str]:
    if ctx.config.memory.seq_len:
        return ctx.config.memory.seq_len, "memory.seq_len"
    for name in ("max_length", "max_seq_length"):
        v = getattr(ctx.args, name, None) if ctx.args is not None else None
        if isinstance(v, int) and v > 0:
            return v, f"the arguments' {name}"
    return None, ""


def decide(ctx: PlanContext) -> Decision:
    s = ctx.config.tiled_mlp
    requested = {"enabled": s.enabled, "tile_tokens": s.tile_tokens}
    if s.enabled is False:
        return Decision(NAME, requested, OFF, settings=Settings(),
                        reason="off in the config (preset long tiles the MLP over the sequence)")
    info = ctx.model
    compile_ = ctx.decisions.get("compile")
    if compile_ is not None and compile_.active and s.enabled == "auto":
        return Decision(NAME, requested, OFF, settings=Settings(),
                        reason="auto: off beside compiled blocks (the tiles would run eager inside each compiled "
                               "region); set tiled_mlp.enabled: true to tile anyway")
    if info is not None and info.num_blocks == 0:
        return Decision(NAME, requested, OFF, settings=Settings(), fallbacks=("tiled_mlp: no repeated block",),
                        reason="cannot tile: no repeated block found in the model")
    shape = info.shape if info is not None else None
    seq, where = _planned_length(ctx)
    fixed = s.tile_tokens != "auto"
    max_tiles = -(-WORKING_SET * shape.intermediate_size // shape.hidden_size) if shape is not None else 8
    if fixed:
        settings = Settings(tile_tokens=s.tile_tokens, fixed=True, max_tiles=max_tiles, seq_len=seq)
        rule_text = f"tiles of {s.tile_tokens} tokens (tiled_mlp.tile_tokens)"
    else:
        settings = Settings(max_tiles=max_tiles, seq_len=seq)
        rule_text = (f"auto: tiles of >= {MIN_TILE_TOKENS} tokens, at most ceil({WORKING_SET} x "
                     + (f"{shape.intermediate_size} / {shape.hidden_size}) = {max_tiles}" if shape is not None
                        else "MLP width / hidden size), 8 for a model not known yet")
                     + " (one tile's MLP working set no larger than one hidden-state tensor of the sequence)")
    if seq is not None:
        tiles = settings.rule.tiles(seq)
        tile = settings.rule.tile_length(seq)
        settings = Settings(**{**settings.__dict__, "tiles": tiles, "tile_tokens": tile})
        at = f"; at {seq} tokens ({where}): {tiles} tile(s) of {tile} tokens"
        if shape is not None:
            c = 2 if getattr(ctx.decisions.get("precision"), "settings", None) is not None and \
                getattr(ctx.decisions["precision"].settings, "dtype", torch.float32) in (torch.bfloat16, torch.float16) \
                else shape.weight_bytes
            per_token = WORKING_SET * shape.intermediate_size * c
            at += f", the MLP working set {fmt_bytes(tile * per_token)} instead of {fmt_bytes(seq * per_token)}"
    else:
        at = "; the tile count follows each batch's length (no memory.seq_len or max_length to state it for)"
    if zero_stage(ctx) == 3:
        count = settings.tiles or settings.max_tiles
        settings = Settings(**{**settings.__dict__, "same_count": True, "tiles": count})
        at += (f"; under ZeRO-3 every batch runs in {count} tiles whatever its length (ZeRO-3 gathers the MLP's "
               "weights at each tile, so every rank must call as often; the gathers cost communication per tile)")
    moe = info is not None and (info.routers or info.expert_parameters)
    note = ("; mixture-of-experts blocks keep their experts untiled (their routers' outputs are recorded per call "
            "for the auxiliary loss), dense blocks are tiled") if moe else ""
    if compile_ is not None and compile_.active:
        note += "; beside compiled blocks the tiles run eager inside each compiled region (a graph break)"
    return Decision(NAME, requested, "tiled", settings=settings,
                    reason=f"each block's MLP over tiles of the sequence, each tile recomputed in backward: "
                           f"{rule_text}{at}{note}")


def training_args(decision: Decision, args) -> dict:
    return {}


# ----------------------------------------------------------------------------------------- apply
def apply(decision: Decision, setup, outcome: Outcome) -> None:
    if not decision.active or setup.model is None:
        return
    tiled, skipped = [], []
    for i, block in enumerate(find_blocks(setup.model)):
        name, mlp = mlp_of(block)
        if mlp is None:
            skipped.append(i)
            continue
        tile_mlp(mlp, decision.settings.rule)
        tiled.append(i)
    outcome.facts.update(blocks=tiled, untiled_blocks=skipped)
    if not tiled:
        outcome.withdraw("no block has a dense MLP that takes the hidden states alone (an encoder's split "
                         "intermediate/output, or experts only): nothing tiled")
        logger.warning("hf_speedup: tiled_mlp: %s", outcome.facts["withdrawn"])
        return
    if skipped:
        outcome.notes.append(f"blocks {_ranges(skipped)} not tiled (a mixture of experts or no dense MLP)")
    logger.info("hf_speedup: tiled MLP in blocks %s of %d", _ranges(tiled), len(tiled) + len(skipped))


# ----------------------------------------------------------------------------------------- during training
def callbacks(decision: Decision, trainer, outcome: Outcome) -> list:
    """The recorders start counting at the first training step (verification probes before it do not count)."""
    if not decision.active:
        return []
    from transformers import TrainerCallback

    class StartRecording(TrainerCallback):
        started = False

        def on_step_begin(self, args, state, control, **kwargs):
            if not self.started:
                self.started = True
                for _, mlp in tiled_mlps(trainer.model):
                    record = tile_record(mlp)
                    record.calls = record.tokens = record.tiles = record.expected = record.mismatched = 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.started = False

    return [StartRecording()]


# ----------------------------------------------------------------------------------------- verify
def tiled_mlps(model) -> list[tuple[int, torch.nn.Module]]:
    """(block index, MLP) of every MLP set up to run tiled, read from the modules themselves."""
    out = []
    for i, block in enumerate(find_blocks(model)):
        _, mlp = mlp_of(block)
        if mlp is not None and tile_record(mlp) is not None:
            out.append((i, mlp))
    return out


def probe_tiles(mlp: torch.nn.Module, tokens: int = 9, tile: int = 4) -> tuple[int, float]:
    """Run ``mlp`` once tiled (``tile`` tokens per tile) and once whole on the same random rows, with gradients on:
    (tiles the recorder saw, the largest relative difference of output and input gradient). The rule is put back.
    Call it inside :func:`~hf_speedup.features.probe.eager_train_mode` (a probe is not a training step)."""
    rule = tile_rule(mlp)
    record = tile_record(mlp)
    weight = next(p for p in mlp.parameters() if p.is_floating_point())  # a 4-bit base stores uint8
    hidden = _in_features(mlp)
    x = torch.randn(1, tokens, hidden, dtype=weight.dtype, device=weight.device, requires_grad=True)
    was_training = [(m, m.training) for m in mlp.modules()]
    mlp.eval()  # no dropout: the tiles draw their masks apart from the whole (gradients still recorded)
    try:
        tile_mlp(mlp, TileRule(tile_tokens=tile))
        out = mlp(x)
        seen = record.probe_tiles
        (g_tiled,) = torch.autograd.grad(out.float().sum(), x)
        inner = mlp.forward._hf_speedup_inner
        ref = inner(x)
        (g_ref,) = torch.autograd.grad(ref.float().sum(), x)
    finally:
        tile_mlp(mlp, rule)
        for m, was in was_training:
            m.training = was
    diff = max(_rel(out, ref), _rel(g_tiled, g_ref))
    return seen, diff


def _in_features(mlp) -> int:
    first = next(m for m in mlp.modules() if hasattr(m, "in_features") or type(m).__name__ == "Conv1D")
    return getattr(first, "in_features", None) or first.weight.shape[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _can_probe(trainer) -> tuple[bool, str]:
    args = getattr(trainer, "args", None)
    if getattr(args, "world_size", 1) > 1 or getattr(trainer, "is_deepspeed_enabled", False) or \
            any(type(p).__name__ == "DTensor" for p in trainer.model.parameters()):
        return False, "sharded or several processes: no probe, the recorder checks the training steps"
    return True, ""


def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    if not decision.active:
        return False, "off"
    if outcome.withdrawn:
        return False, outcome.withdrawn
    mlps = tiled_mlps(trainer.model)
    if not mlps:
        return False, "no MLP is set up to run tiled on the live model"
    where = f"{len(mlps)} MLPs tiled (blocks {_ranges([i for i, _ in mlps])})"
    ran = [(i, tile_record(m)) for i, m in mlps if tile_record(m).calls]
    if ran:  # training has run: what the recorder saw in the steps
        bad = [i for i, r in ran if r.mismatched]
        outcome.facts["seen"] = {"tokens": ran[-1][1].tokens, "tiles": ran[-1][1].tiles,
                                 "mlps_run": len(ran), "calls": sum(r.calls for _, r in ran)}
        if bad:
            return False, f"{where}, but blocks {_ranges(bad)} ran a tile count other than planned"
        if len(ran) < len(mlps):
            return False, f"{where}, but only {len(ran)} of them ran tiled in training"
        last = ran[-1][1]
        return True, (f"{where}; the recorder saw every one run in the planned tiles (last batch: {last.tokens} "
                      f"tokens in {last.tiles} tile(s))")
    ok, why_not = _can_probe(trainer)
    if not ok:
        return True, f"{where} ({why_not})"
    try:
        with eager_train_mode(trainer.model):
            seen, diff = probe_tiles(mlps[0][1])
    except Exception as exc:  # an unusual MLP must not hide the structural check
        return True, f"{where} (probe failed, checked structurally only: {exc!r})"
    limit = 1e-4 if next(p for p in mlps[0][1].parameters() if p.is_floating_point()).dtype == torch.float32 else 2e-2
    if seen != 3 or diff > limit:
        return False, f"{where}, but a probe of 9 tokens in tiles of 4 ran {seen} tile(s), difference {diff:.1e}"
    return True, f"{where}; a probe ran 9 tokens in 3 tiles, output and input gradient equal to the untiled MLP's"


def _ranges(idx: list[int]) -> str:
    return ", ".join(str(i) for i in idx) if len(idx) <= 8 else f"{idx[0]}..{idx[-1]}"
