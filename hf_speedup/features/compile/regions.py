"""The compiled regions at run time: each one a guarded call that falls back to eager, recorded, never silent.

:func:`compile_module` installs a :class:`GuardedRegion` in place of a module's call (the blocks, the final norm,
lm_head), :class:`CompiledLoss` wraps the model's loss function; :func:`guarded_regions` finds them again on a
live model and :func:`compile_stats` sums their compiles, recompiles, compile seconds and fallbacks.
"""

from __future__ import annotations

import logging
import time
import types
from typing import Any, Callable

from ... import compat
from ...blocks import find_final_norm, unwrap_model
from .payback import CompileGate

logger = logging.getLogger("hf_speedup")

HEAD_REGIONS = ("final_norm", "lm_head", "loss")


# --------------------------------------------------------------------------------------------- regions
class GuardedRegion:
    """The compiled call of one region; a compiler failure switches it to eager, recorded, never silent.

    Installed as ``module._compiled_call_impl`` (what ``nn.Module.compile()`` sets), or used as a plain
    callable for functions such as the loss. ``kind`` groups identical regions (all blocks share one
    compiled graph); ``compiles`` counts calls that produced new dynamo graphs, so ``recompiles`` is
    every compile of a kind after its first.
    """

    def __init__(self, eager: Callable, kind: str, label: str, compile_kwargs: dict, target: Callable | None = None,
                 gate: CompileGate | None = None):
        import torch

        self.eager = eager
        self.kind = kind
        self.label = label
        self.compile_kwargs = dict(compile_kwargs)
        self.compiled = torch.compile(target or eager, **compile_kwargs)
        self.gate = gate if gate is not None else CompileGate()
        self.fallback_reason: str | None = None
        self.calls = 0  # forwards that went through the compiled callable (a cached graph compiles nothing new)
        self.compiles = 0
        self.compile_seconds = 0.0

    @property
    def running_compiled(self) -> bool:
        return self.fallback_reason is None and self.gate.open

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.running_compiled or _decoding(kwargs):
            return self.eager(*args, **kwargs)
        self.calls += 1
        before = _graphs_so_far()
        start = time.perf_counter()
        try:
            with _eager_backward_lowering():
                out = self.compiled(*args, **kwargs)
        except Exception as exc:  # compile errors come in many types; eager decides if it was ours
            return self._fall_back(exc, args, kwargs)
        if _graphs_so_far() != before:
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - start
        return out

    def _fall_back(self, exc: Exception, args: tuple, kwargs: dict) -> Any:
        """Run eager; if eager fails too the error is the input's, not the compiler's: re-raise it."""
        out = self.eager(*args, **kwargs)
        self.fallback_reason = _describe(exc)
        logger.warning("hf_speedup: compiling %s failed, it runs eager from now on (training goes on): %s",
                       self.label, self.fallback_reason)
        return out

    def __repr__(self) -> str:
        state = f"eager fallback ({self.fallback_reason})" if self.fallback_reason else "compiled"
        return f"GuardedRegion({self.label}, {state})"


def _decoding(kwargs: dict) -> bool:
    """A no-grad forward with a KV cache (``generate()``, TRL's online trainers between steps): eager. Each
    block's cache slot is a different guard, so compiling it would spend dynamo's recompile limit, which the
    blocks share (one ``forward`` code object), and leave the training steps after it running eager."""
    if compat.kv_cache_arg(kwargs) is None:
        return False
    import torch

    return not torch.is_grad_enabled()


def _graphs_so_far() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _eager_backward_lowering():
    """Lower the backward at forward-compile time, so its failures are caught by the guarded call."""
    import torch._functorch.config as fconfig

    return fconfig.patch(force_non_lazy_backward_lowering=True)


def _describe(exc: BaseException) -> str:
    """``Outer: first line`` plus the root cause (dynamo wraps the backend's own error)."""
    root = exc
    for _ in range(8):
        inner = getattr(root, "inner_exception", None) or root.__cause__
        if inner is None or inner is root:
            break
        root = inner
    text = f"{type(exc).__name__}: {_first_line(exc)}"
    if root is not exc:
        text += f" {type(root).__name__}: {_first_line(root)}"
    return text[:400]


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0] if lines else repr(exc)


def compile_module(module, kind: str, label: str, compile_kwargs: dict, gate: CompileGate | None = None) -> bool:
    """Compile ``module`` in place; idempotent (False when it already runs a GuardedRegion).

    Like ``nn.Module.compile()``, the target is ``_call_impl``: dynamo runs that frame (hooks) eager and
    compiles the module's ``forward``. Dynamo never compiles a top-level frame from torch itself, so a
    ``torch.nn`` class (e.g. the ``nn.Linear`` lm_head) is entered through a trampoline of ours instead.
    """
    current = getattr(module, "_compiled_call_impl", None)
    if isinstance(current, GuardedRegion):
        if gate is not None:  # a model reused by another trainer: that trainer's gate decides from now on
            current.gate = gate
        return False
    if current is not None:
        logger.info("hf_speedup: %s was already compiled by the caller; recompiling it as a guarded region", label)
    target = None
    if type(module).__module__.startswith("torch."):
        target = types.MethodType(_trampoline(kind), module)
    module._compiled_call_impl = GuardedRegion(module._call_impl, kind, label, compile_kwargs, target, gate)
    return True


def _trampoline(kind: str) -> Callable:
    """A user-code frame that calls ``module._call_impl``; its own code object gives each kind its own
    dynamo cache (and recompile limit)."""

    def region(module, *args, **kwargs):
        return module._call_impl(*args, **kwargs)

    region.__code__ = region.__code__.replace(co_name=f"hf_speedup_{kind}".replace(".", "_"))
    return region


def _compile_head(model, compile_kwargs: dict, gate: CompileGate | None = None) -> list[str]:
    """Final norm, lm_head (in place) and the loss function; returns the regions compiled."""
    base = unwrap_model(model)
    done = []
    norm = find_final_norm(base)
    if norm is not None and compile_module(norm, "final_norm", "final norm", compile_kwargs, gate):
        done.append("final_norm")
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is not None and compile_module(head, "lm_head", "lm_head", compile_kwargs, gate):
        done.append("lm_head")
    loss = getattr(base, "_loss_function", None)
    if isinstance(loss, CompiledLoss) and gate is not None:
        loss.region.gate = gate
    elif hasattr(type(base), "loss_function") and not isinstance(loss, CompiledLoss):
        base.loss_function = CompiledLoss(base.loss_function, compile_kwargs, gate)
        done.append("loss")
    return done


class CompiledLoss:
    """The model's loss function as a guarded region; ints such as ``num_items_in_batch`` become
    tensors so a changing token count does not recompile the graph every step."""

    def __init__(self, fn: Callable, compile_kwargs: dict, gate: CompileGate | None = None):
        self.fn = fn
        self.region = GuardedRegion(fn, "loss", "loss", compile_kwargs, gate=gate)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        n = kwargs.get("num_items_in_batch")
        if isinstance(n, int) and not isinstance(n, bool):
            kwargs["num_items_in_batch"] = torch.tensor(n)
        return self.region(*args, **kwargs)


def guarded_regions(model) -> list[GuardedRegion]:
    """Every guarded region reachable from ``model`` (modules compiled in place, the compiled loss)."""
    out: list[GuardedRegion] = []
    for m in model.modules():
        region = getattr(m, "_compiled_call_impl", None)
        if isinstance(region, GuardedRegion):
            out.append(region)
        loss = m.__dict__.get("_loss_function")
        if isinstance(loss, CompiledLoss):
            out.append(loss.region)
    return out


def compile_stats(model) -> dict:
    """Regions, compiles, recompiles, compile seconds and fallbacks of the guarded regions of ``model``."""
    regions = guarded_regions(model)
    per_kind: dict[str, int] = {}
    for r in regions:
        per_kind[r.kind] = per_kind.get(r.kind, 0) + r.compiles
    return {
        "compiled_regions": sum(r.running_compiled for r in regions),
        "compiles": sum(per_kind.values()),
        "recompiles": sum(max(0, n - 1) for n in per_kind.values()),
        "compile_seconds": sum(r.compile_seconds for r in regions),
        "fallbacks": {r.label: r.fallback_reason for r in regions if r.fallback_reason},
    }


def gate_of(model) -> CompileGate | None:
    regions = guarded_regions(model)
    return regions[0].gate if regions else None
