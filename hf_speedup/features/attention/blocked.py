"""``blocked``: hf_speedup's CPU attention kernel for training (causal, grouped keys, padding-free rows).

Why: torch's CPU flash kernel runs its bf16 forward + backward far below the matrix units' speed (RESULTS.md:
~150 GFLOP/s at 1,024 tokens where a bf16 GEMM runs ~1-2 TFLOP/s). Here each block of ``BLOCK`` queries meets all
the keys it may see in a few large GEMMs (ATen's bmm), the query heads that share a key/value head stacked on it
(keys and values read in place, no per-head copies), with the softmax between the GEMMs one fused, vectorised
fp32 pass per row (``csrc/blocked_attention.cpp``). Scores exist for one block at a time (memory linear in the
length); the backward recomputes them from the saved log-sum-exp. Sequences of a padding-free row come from
``position_ids`` (a restart marks a new one, as for ``sdpa_varlen``): each query's keys are the contiguous range
from its sequence's start to itself, so no mask is built and earlier sequences' keys are skipped.

The C++ part is built by torch's ``cpp_extension`` on first use, once per machine (cached under
``TORCH_EXTENSIONS_DIR``, ~15 s with gcc), for the vector width torch itself runs (AVX-512 / AVX2). Where it does
not build (no compiler, no ninja) :func:`load` says why and the plan keeps ``sdpa_varlen``. The op is
``hf_speedup::blocked_attention`` with a fake implementation: compiled blocks see one opaque call, no graph break.
Whether it beats torch's kernel depends on the machine and shapes: ``auto`` times both at the door
(:mod:`.door`) and takes it only where it measured faster.

On CPUs whose matrix units oneDNN drives (AMX), bf16 runs a tiled form instead (``csrc/blocked_tiles.cpp``): a
tile of queries x keys at a time, flash-style, so the scores stay in cache from the score GEMM through the
softmax to the next GEMM, each GEMM one oneDNN micro-kernel call on operands packed once. Same op, same exactness
tests. Which form and tile size pays depends on the shapes (RESULTS.md): the door times each (:func:`use` sets
what it found fastest).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ...memory_model import BLOCKED_QUERIES

NAME = "blocked"
BLOCK = BLOCKED_QUERIES  # GEMMs of 128 x heads-per-group rows, the diagonal block's waste <= 128 / length; the
# memory model sizes the kernel's working set by it
TILE_CHOICES = ("64x64", "64x128", "128x128")  # queries x keys of a tile of the tiled form; the door times each
DEFAULT_FORM = "64x128"  # where the door did not measure (HF_SPEEDUP_MEASURE=0, an explicit kernel)
SOURCE = Path(__file__).with_name("csrc") / "blocked_attention.cpp"
SOURCES = (SOURCE, SOURCE.with_name("blocked_tiles.cpp"))
logger = logging.getLogger("hf_speedup")
_STATE: dict[str, object] = {}
FORM = [DEFAULT_FORM]  # the run's form: tiles "QxK", or "bmm" (ATen's bmm where tiles could run); see use()
CALLS = [0]  # forward calls of the kernel in this process (the verification reads it)
TILED = [0]  # of which ran the tiled form

# torch's own vector width on this CPU -> the flags its kernels are built with (ATen's Vectorized follows them)
FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}


def capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return "DEFAULT"


def load() -> tuple[bool, str]:
    """(the kernel is loaded in this process, how or why not). Builds it the first time on this machine."""
    if "ok" in _STATE:
        return bool(_STATE["ok"]), str(_STATE["why"])
    cap = capability()
    try:
        from torch.utils import cpp_extension

        cpp_extension.load(name=f"hf_speedup_blocked_attention_{cap.lower()}", sources=[str(path) for path in SOURCES],
                           extra_cflags=["-O3", "-fopenmp", *FLAGS.get(cap, [])], extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
        lanes = torch.ops.hf_speedup_cpu.vector_lanes()
        tiles = "its tiled bf16 form can run (AMX, oneDNN micro-kernels)" if \
            torch.ops.hf_speedup_cpu.tiles_available() else "bf16 through ATen's bmm only (no AMX oneDNN drives here)"
        ok, why = True, f"C++ kernel built for {cap} ({lanes} fp32 lanes), {tiles}"
    except Exception as exc:  # no compiler, no ninja, a read-only cache: the plan keeps torch's kernel
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        first = next((line for line in lines if "error" in line.lower() and ".cpp" in line), None) or \
            (lines[0] if lines else type(exc).__name__)  # the compiler's own first error where there is one
        ok, why = False, f"its C++ kernel did not build here ({type(exc).__name__}: {first[:300]})"
        logger.warning("hf_speedup attention: blocked kernel unavailable: %s", why)
    _STATE.update(ok=ok, why=why)
    return ok, why


def use(form: str | None) -> None:
    """Set the form calls run: "bmm", a tile size "QxK" (the door's fastest), or None (the default tiles)."""
    FORM[0] = form or DEFAULT_FORM


def tiles() -> tuple[int, int]:
    """(queries, keys) of the run's tiles."""
    queries, keys = (FORM[0] if FORM[0] != "bmm" else DEFAULT_FORM).split("x")
    return int(queries), int(keys)


def can_tile(query: torch.Tensor) -> bool:
    """Whether the tiled form can run this call: bf16, matrix units oneDNN drives, a head size of whole vectors."""
    return query.dtype == torch.bfloat16 and query.shape[-1] % 16 == 0 and \
        bool(torch.ops.hf_speedup_cpu.tiles_available())


def tiled(query: torch.Tensor) -> bool:
    """Whether this call runs the tiled form: it can, and the run's form is not the bmm one."""
    return FORM[0] != "bmm" and can_tile(query)


def sequence_starts(position_ids: torch.Tensor, batch: int) -> torch.Tensor:
    """(rows, T) int64: the index where each position's sequence starts (a restart of the positions marks one)."""
    rows = position_ids.reshape(-1, position_ids.shape[-1]).to(torch.long)
    if rows.shape[0] not in (1, batch):
        raise ValueError(f"position_ids has {rows.shape[0]} rows for a batch of {batch}")
    new = torch.diff(rows, prepend=rows[:, :1] + 1, dim=-1) != 1
    index = torch.arange(rows.shape[-1], device=rows.device).expand_as(rows)
    return torch.where(new, index, torch.zeros_like(index)).cummax(-1).values.contiguous()


@torch.library.custom_op("hf_speedup::blocked_attention", mutates_args=())
def blocked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position_ids: torch.Tensor,
                      scale: float, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of every sequence of each row with itself: (output like ``query``, fp32 log-sum-exp)."""
    CALLS[0] += 1
    starts = sequence_starts(position_ids, query.shape[0])
    if tiled(query):
        TILED[0] += 1
        return torch.ops.hf_speedup_cpu.blocked_tiles_forward(query, key, value, starts, scale, *tiles())
    return torch.ops.hf_speedup_cpu.blocked_attention_forward(query, key, value, starts, scale, block)


@blocked_attention.register_fake
def _(query, key, value, position_ids, scale, block):
    return torch.empty_like(query), query.new_empty(query.shape[:3], dtype=torch.float32)


@torch.library.custom_op("hf_speedup::blocked_attention_backward", mutates_args=())
def blocked_attention_backward(grad: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               out: torch.Tensor, lse: torch.Tensor, position_ids: torch.Tensor, scale: float,
                               block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    starts = sequence_starts(position_ids, query.shape[0])
    if tiled(query):
        return torch.ops.hf_speedup_cpu.blocked_tiles_backward(grad, query, key, value, out, lse, starts, scale,
                                                                *tiles())
    return torch.ops.hf_speedup_cpu.blocked_attention_backward(grad, query, key, value, out, lse, starts, scale,
                                                                block)


@blocked_attention_backward.register_fake
def _(grad, query, key, value, out, lse, position_ids, scale, block):
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _setup_context(ctx, inputs, output):
    query, key, value, position_ids, scale, block = inputs
    out, lse = output
    ctx.save_for_backward(query, key, value, out, lse, position_ids)
    ctx.scale, ctx.block = scale, block


def _backward(ctx, grad_out, grad_lse):
    query, key, value, out, lse, position_ids = ctx.saved_tensors
    dq, dk, dv = torch.ops.hf_speedup.blocked_attention_backward(grad_out, query, key, value, out, lse, position_ids,
                                                                 ctx.scale, ctx.block)
    return dq, dk, dv, None, None, None


blocked_attention.register_autograd(_backward, setup_context=_setup_context)


def run(query, key, value, position_ids, scale: float) -> torch.Tensor:
    """(B, H, T, D) queries over (B, Hkv, T, D) keys and values -> (B, H, T, D) output."""
    out, _ = torch.ops.hf_speedup.blocked_attention(query, key, value, position_ids, float(scale), BLOCK)
    return out


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers' attention signature; the calls it cannot serve go to sdpa exactly as ``sdpa_varlen``'s do."""
    from .sdpa_varlen import attention_call

    return attention_call(NAME, run, module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                          is_causal=is_causal, grouped=True, dtypes=(torch.float32, torch.bfloat16), **kwargs)


def register() -> str:
    """Make ``blocked`` a transformers attention implementation (idempotent); the kernel must be loaded."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .sdpa_varlen import mask_function

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, mask_function)
    return NAME
