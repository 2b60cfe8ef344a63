"""Regional torch.compile: each repeated decoder block compiled in place (optionally the head too).

Why regional: the blocks are identical, so dynamo compiles one graph and reuses it for every block
(cold start is one block's compile, not the whole model's), and the rest of the model stays eager.
Why in place (``module.compile()``-style ``_compiled_call_impl``): ``nn.Module.__call__`` stays on the
call path, so hooks added later (FSDP2's ``fully_shard``, peft) still run, and ``_orig_mod``-style
wrappers never appear in state dicts.

Every region goes through :class:`GuardedRegion`: if compiling (or running compiled) fails, that
region runs eager from then on, training goes on, and the failure is recorded (``fallback_reason``)
so ``verify`` and the report say which regions fell back and why. Backward graphs are lowered
together with the forward (``force_non_lazy_backward_lowering``) so backward compile errors surface
inside the guarded call too, not later in ``loss.backward()`` where no fallback is possible.

Region statistics (compiles, recompiles, compile seconds, fallbacks) are kept on each region and
summed by :func:`compile_stats`.

``mode='max-autotune'`` on CPU also autotunes the GEMM library per shape (MKL or oneDNN, see "CPU GEMMs"
below): inductor's own CPU GEMM templates only serve frozen (inference) weights, and the fp32 GEMMs are
most of a small model's training step.
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass, replace
from typing import Any, Callable

from ... import compat
from ...blocks import find_blocks, find_final_norm, unwrap_model
from ...hardware import cpu_name
from ...plan_types import OFF, Decision, Outcome, PlanContext
from ..probe import steps_trained
from .payback import MEASURED_STEPS, PAYBACK, CompileGate, PaybackCallback, compile_cost_text

NAME = "compile"
APPLIES_TO = "model"
logger = logging.getLogger("hf_speedup")

HEAD_REGIONS = ("final_norm", "lm_head", "loss")


# --------------------------------------------------------------------------------------------- decide
@dataclass(frozen=True)
class Settings:
    backend: str
    mode: str | None
    dynamic: bool | None
    fullgraph: bool
    regions: str  # blocks | blocks+head
    block_class: str | None
    num_blocks: int
    cpu_gemm: str = "default"  # autotune: each CPU GEMM shape on MKL or oneDNN, whichever is faster
    when: str = "always"  # always | pays_back (the first steps eager, compiled only if it earns back; compile_payback)


def _off(requested: Any, reason: str, settings: Settings, fallbacks: list | None = None) -> Decision:
    return Decision(NAME, requested=requested, applied=OFF, reason=reason, settings=settings,
                    fallbacks=tuple(fallbacks or ()))


def decide(ctx: PlanContext) -> Decision:
    """On/off and the concrete compile parameters; pure (reads config, capabilities, model info)."""
    cfg = ctx.config.compile
    caps = ctx.caps
    info = ctx.model
    requested = cfg.enabled
    settings = Settings(backend=cfg.backend, mode=cfg.mode, dynamic=cfg.dynamic, fullgraph=cfg.fullgraph,
                        regions=cfg.regions, block_class=getattr(info, "block_class", None),
                        num_blocks=getattr(info, "num_blocks", 0), when=_when(cfg.when, caps))
    explicit = requested is True
    if requested is False:
        return _off(requested, "compile.enabled = false", settings)
    if ctx.args is not None and getattr(ctx.args, "torch_compile", False):
        return _off(requested, "TrainingArguments.torch_compile=True: the stock Trainer compiles the whole model; "
                    "left alone, regional compile skipped so nothing is compiled twice", settings)
    if getattr(info, "compiled_whole", False):
        return _off(requested, "the model passed in is already compiled whole (torch.compile(model) or "
                    "model.compile()): left alone, regional compile skipped so nothing is compiled twice", settings)
    if not caps.compile:
        why = f"torch.compile is not usable here: {caps.compile_reason or 'no compiler toolchain'}"
        return _off(requested, why, settings, [f"compile: {why}"] if explicit else [])
    if cfg.backend == "cudagraphs" and not caps.is_cuda:
        why = f"compile.backend = 'cudagraphs' needs a CUDA device; this is {caps.device_type}"
        return _off(requested, why, settings, [f"compile: {why}"] if explicit else [])
    if info is None or not info.block_class or not info.num_blocks:
        why = ("no repeated decoder block found (neither _no_split_modules nor a homogeneous ModuleList); "
               "regional compile has nothing to compile")
        return _off(requested, why, settings, [f"compile: {why}"] if explicit else [])
    lora = ctx.decisions.get("lora")
    if lora is not None and lora.active and getattr(lora.settings, "target_parameters", ()):
        why = ("LoRA on the experts' fused weights (peft's lora.ParamWrapper) registers a parametrization at every "
               "forward: dynamo would recompile the blocks at each step until its recompile_limit, then run them "
               "eager (peft advises against compiling with target_parameters)")
        return _off(requested, why, settings, [f"compile: {why}"] if explicit else [])
    if requested == "auto" and not caps.is_cuda:
        return _off(requested, f"auto: off on {caps.device_type} (a cold compile costs tens of seconds for small "
                    "gains here); use preset 'fast' for compiled blocks on CPU", settings)
    if _padding_free(ctx) and settings.dynamic is not True:
        settings = replace(settings, dynamic=True)  # one graph for every row length (see _on_reason)
    if caps.is_cuda and settings.dynamic is True and settings.mode == "max-autotune":
        settings = replace(settings, mode=NO_CUDAGRAPHS)  # see _on_reason
    autotune = _autotunes_cpu_gemms(cfg, caps) and settings.dynamic is not True
    settings = replace(settings, cpu_gemm="autotune" if autotune else "default")
    return Decision(NAME, requested=requested, applied=f"{cfg.regions}:{cfg.backend}",
                    reason=_on_reason(ctx, settings), settings=settings)


NO_CUDAGRAPHS = "max-autotune-no-cudagraphs"


def _when(asked: str, caps) -> str:
    """``pays_back`` only where the payback constants were measured and one process decides alone."""
    return "pays_back" if asked == "pays_back" and caps.device_type in PAYBACK and not caps.distributed else "always"


def _when_reason(asked: str, s: Settings, caps) -> str:
    if asked != "pays_back":
        return ""
    if s.when == "pays_back":
        gain = PAYBACK[caps.device_type][0]
        return (f"compile.when = pays_back: the first steps run eager and are timed; the blocks compile only if the "
                f"remaining eager time x {gain:.0%} (what compiled blocks saved on {caps.device_type}) exceeds "
                f"{compile_cost_text(caps.device_type, s.dynamic is not True)}")
    if caps.distributed:
        return (f"compile.when = pays_back: compiled from the first step on all {caps.world_size} processes (ranks "
                "timing their own steps could decide differently)")
    return (f"compile.when = pays_back: compiled from the first step (compile gain and cost not measured on "
            f"{caps.device_type} yet)")


def _on_reason(ctx: PlanContext, s: Settings) -> str:
    """Why it is on, plus what it composes with (LoRA, checkpointing, FSDP, shapes)."""
    head = " + final norm, lm_head and loss" if s.regions == "blocks+head" else ""
    parts = [f"{s.num_blocks} x {s.block_class} compiled in place{head} "
             f"(backend={s.backend}, mode={s.mode or 'default'}, dynamic={s.dynamic})"]
    if ctx.config.compile.enabled == "auto":
        parts.append(f"auto: on for {ctx.caps.device_type} ({ctx.caps.compile_reason or 'compiler present'})")
    for feat, note in (("lora", "blocks include peft LoRA layers"),
                       ("checkpointing", "checkpointed forward is traced inside the compiled block"),
                       ("fsdp", "compiled in place so FSDP hooks installed later still run")):
        d = ctx.decisions.get(feat)
        if d is not None and d.active:
            parts.append(note)
    if s.cpu_gemm == "autotune":
        parts.append("max-autotune on CPU: each GEMM shape runs on MKL or oneDNN, whichever is faster here "
                     "(inductor's own GEMM templates need frozen weights, so they cannot serve training)")
    if when := _when_reason(ctx.config.compile.when, s, ctx.caps):
        parts.append(when)
    if s.mode == NO_CUDAGRAPHS and ctx.config.compile.mode == "max-autotune":
        parts.append("max-autotune without CUDA graphs: with a dynamic sequence dimension inductor would record "
                     "new graphs for every length seen, their memory pool growing step after step")
    if _padding_free(ctx):
        parts.append(f"padding-free rows change length every step: the sequence dimension is compiled dynamic "
                     f"(dynamic={ctx.config.compile.dynamic} asked), one graph for every length instead of a "
                     "recompile per length; measured faster than bucketing row lengths (benchmarks/RESULTS.md)")
        if _autotunes_cpu_gemms(ctx.config.compile, ctx.caps):
            parts.append("CPU GEMM autotune off: symbolic GEMM sizes have no single shape to time")
    elif s.dynamic is False and not ctx.config.data.pad_to_multiple_of:
        parts.append("dynamic=False without data.pad_to_multiple_of: each new sequence length recompiles "
                     "(after torch._dynamo's recompile_limit that region runs eager)")
    return "; ".join(parts)


def _padding_free(ctx: PlanContext) -> bool:
    """Rows change length every step: our padding-free collator, or TRL's own packing / padding_free."""
    data = ctx.decisions.get("data")
    return bool(data is not None and (getattr(data.settings, "padding_free", False)
                                      or getattr(data.settings, "rows_flattened", False)))


def _autotunes_cpu_gemms(cfg, caps) -> bool:
    return (cfg.backend == "inductor" and not caps.is_cuda and caps.device_type == "cpu"
            and cfg.mode in ("max-autotune", "max-autotune-no-cudagraphs"))


def training_args(decision: Decision, args) -> dict:
    """Regional compile is not expressible in TrainingArguments (its torch_compile is whole-model)."""
    return {}


def callbacks(decision: Decision, trainer, outcome: Outcome) -> list:
    """``pays_back``: the callback that times the first steps and opens the regions' gate, or declines."""
    if not decision.active or decision.settings.when != "pays_back":
        return []
    return [PaybackCallback(trainer, outcome, trainer.speedup_plan.caps.device_type, gate_of,
                            static_shapes=decision.settings.dynamic is not True)]


def gate_of(model) -> CompileGate | None:
    regions = guarded_regions(model)
    return regions[0].gate if regions else None


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


# --------------------------------------------------------------------------------------------- apply
def compile_kwargs_of(decision: Decision, cpu_gemm: str | None = None) -> dict:
    """torch.compile arguments; the CPU GEMM pass needs ``options`` (torch forbids ``mode`` with them).

    ``cpu_gemm`` is what :func:`settle_cpu_gemm` found at apply time (default: the plan's choice)."""
    s = decision.settings
    kw = dict(backend=s.backend, dynamic=s.dynamic, fullgraph=s.fullgraph)
    if s.backend == "inductor" and s.mode is not None:
        kw["mode"] = s.mode
    if (cpu_gemm or s.cpu_gemm) == "autotune":
        import torch._inductor

        options = dict(torch._inductor.list_mode_options(s.mode or "default", s.dynamic))
        options["post_grad_custom_post_pass"] = cpu_gemm_pass()
        kw.pop("mode", None)
        kw["options"] = options
    return kw


def settle_cpu_gemm(decision: Decision, outcome: Outcome) -> str:
    """The CPU GEMM choice in force: the autotune stays only where oneDNN can be routed to and computes
    true fp32 here (checked at run time); otherwise a recorded fallback to the default BLAS."""
    if decision.settings.cpu_gemm != "autotune":
        return decision.settings.cpu_gemm
    ok, why = onednn_fp32_ok()
    cpu_gemm = "autotune" if ok else "default"
    outcome.facts["cpu_gemm"] = cpu_gemm
    if not ok:
        outcome.fallbacks.append(f"cpu_gemm: {why}; GEMMs stay on the default BLAS")
        logger.info("hf_speedup: CPU GEMM autotune off: %s", why)
    return cpu_gemm


def apply(decision: Decision, setup, outcome: Outcome) -> None:
    """Compile every block in place (and the head when ``regions='blocks+head'``)."""
    if not decision.active:
        return
    kwargs = compile_kwargs_of(decision, settle_cpu_gemm(decision, outcome))
    gate = CompileGate(open_=decision.settings.when == "always")  # pays_back: PaybackCallback opens it, or not
    blocks = find_blocks(setup.model)
    for i, block in enumerate(blocks):
        compile_module(block, type(block).__name__, f"{type(block).__name__}[{i}]", kwargs, gate)
    head = _compile_head(setup.model, kwargs, gate) if decision.settings.regions == "blocks+head" else []
    outcome.facts["compiled_head"] = head
    logger.info("hf_speedup: compiled %d %s block(s)%s in place (%s)", len(blocks), decision.settings.block_class,
                f" + {', '.join(head)}" if head else "", ", ".join(f"{k}={v}" for k, v in kwargs.items()))


# --------------------------------------------------------------------------------------------- CPU GEMMs
# Measured on a 2-core AMD EPYC (Zen 4, no AMX): MKL runs the fp32 GEMMs of a small Llama at ~65% of peak,
# oneDNN's matmul 20-30% faster for most shapes. torch routes fp32 ``aten::mm`` to oneDNN only under
# ``fp32_precision = "bf16"``, which on CPUs without AMX still computes in fp32 (checked at run time by
# :func:`onednn_fp32_ok`; where oneDNN would really round to bf16 the autotune stays off). The flag is set
# around each chosen GEMM only: set globally it also reaches the small GEMMs inside SDPA's flash kernel,
# which then get 3x slower.

ONEDNN_MIN_GAIN = 0.05  # oneDNN must beat the default BLAS by 5% on a shape to be chosen
GEMM_CHOICES: dict[tuple, dict] = {}  # (sizes, strides) -> {"choice", "default_s", "onednn_s"}
GEMM_NODES = {"onednn": 0, "default": 0}  # mm nodes given to each library by the pass (this process)
GEMM_CALLS = [0]  # hf_speedup::onednn_mm calls run (this process)
_OP = None
_PASS = None


def _register_onednn_mm():
    """``hf_speedup::onednn_mm(a, b)``: ``torch.mm`` with oneDNN's matmul; opaque to inductor."""
    global _OP
    if _OP is None:
        import torch

        lib = torch.library.Library("hf_speedup", "FRAGMENT")
        lib.define("onednn_mm(Tensor a, Tensor b) -> Tensor")
        lib.impl("onednn_mm", onednn_mm, "CPU")
        lib.impl("onednn_mm", lambda a, b: a.new_empty((a.shape[0], b.shape[1])), "Meta")
        _register_onednn_mm.lib = lib  # the Library must outlive this call
        _OP = torch.ops.hf_speedup.onednn_mm.default
    return _OP


_PRECISION_API = None


def onednn_mm(a, b):
    global _PRECISION_API
    import torch

    if _PRECISION_API is None:
        _PRECISION_API = compat.mkldnn_matmul_precision_api()
    get, set_ = _PRECISION_API
    GEMM_CALLS[0] += 1
    previous = get()
    set_("bf16")
    try:
        return torch.mm(a, b)
    finally:
        set_(previous)


def onednn_fp32_ok() -> tuple[bool, str]:
    """oneDNN matmul reachable, and as exact as fp32 here (error vs fp64 within 4x of the default BLAS)."""
    import torch

    if compat.mkldnn_matmul_precision_api() is None:
        return False, f"torch {torch.__version__} cannot route fp32 matmuls to oneDNN (no fp32_precision API)"
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 512, generator=g), torch.randn(512, 256, generator=g)
    exact = a.double() @ b.double()
    err_default = (torch.mm(a, b).double() - exact).abs().max().item()
    try:
        err_onednn = (onednn_mm(a, b).double() - exact).abs().max().item()
    except RuntimeError as exc:  # e.g. a CPU/oneDNN build that refuses the precision setting
        return False, f"oneDNN matmul could not run here ({_first_line(exc)})"
    if err_onednn > 4 * err_default + 1e-6:
        return False, (f"oneDNN would round fp32 GEMMs to bf16 on this CPU (error {err_onednn:.1e} vs "
                       f"{err_default:.1e}); use precision bf16 instead")
    return True, "oneDNN matmul computes in fp32 here"


def cpu_gemm_pass():
    """The post-grad inductor pass that picks MKL or oneDNN per GEMM shape (one instance: stable cache key)."""
    global _PASS
    if _PASS is None:
        from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

        class CpuGemmChoice(CustomGraphPass):
            """Swap ``aten.mm`` nodes for ``hf_speedup::onednn_mm`` where oneDNN measured faster."""

            def __call__(self, graph) -> None:
                choose_cpu_gemms(graph)

            def uuid(self):
                return (get_hash_for_files((__file__,)), cpu_name())

        _register_onednn_mm()
        _PASS = CpuGemmChoice()
    return _PASS


def choose_cpu_gemms(graph) -> None:
    import torch

    op = _register_onednn_mm()
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.mm.default:
            continue
        choice = _gemm_choice(*(arg.meta.get("val") for arg in node.args[:2]))
        GEMM_NODES[choice] += 1
        if choice == "onednn":
            node.target = op


def _gemm_choice(a, b) -> str:
    """Benchmark this exact GEMM (sizes, strides) both ways once per process; 'default' when unsure."""
    import torch

    if not all(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu" for t in (a, b)):
        return "default"
    try:
        key = tuple((tuple(int(x) for x in t.shape), tuple(int(x) for x in t.stride())) for t in (a, b))
    except (TypeError, ValueError):  # symbolic sizes (dynamic shapes): nothing concrete to measure
        return "default"
    if key not in GEMM_CHOICES:
        GEMM_CHOICES[key] = benchmark_gemm(key)
    return GEMM_CHOICES[key]["choice"]


def benchmark_gemm(key: tuple, reps: int = 7) -> dict:
    import torch
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), torch.no_grad():
        a, b = (torch.empty_strided(size, stride).normal_() for size, stride in key)
        times = {}
        for name, fn in (("default", torch.mm), ("onednn", onednn_mm), ("default", torch.mm), ("onednn", onednn_mm)):
            fn(a, b)
            best = min(_timed(fn, a, b) for _ in range(reps))
            times[name] = min(best, times.get(name, best))
    choice = "onednn" if times["onednn"] < (1 - ONEDNN_MIN_GAIN) * times["default"] else "default"
    return {"choice": choice, "default_s": times["default"], "onednn_s": times["onednn"]}


def _timed(fn, a, b) -> float:
    start = time.perf_counter()
    fn(a, b)
    return time.perf_counter() - start


def cpu_gemm_summary() -> str:
    n = GEMM_NODES["onednn"] + GEMM_NODES["default"]
    chosen = (f"oneDNN chosen for {GEMM_NODES['onednn']}/{n} GEMM nodes (autotuned per shape vs the default BLAS)"
              if n else "GEMM choices loaded from inductor's cache (autotuned by an earlier run)")
    return f"{chosen}, {GEMM_CALLS[0]} oneDNN GEMM calls run so far"


# --------------------------------------------------------------------------------------------- verify
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


def verify(decision: Decision, trainer, outcome: Outcome) -> tuple[bool, str]:
    """Each block of the live model runs a compiled (not fallen back) region."""
    if not decision.active:
        return False, decision.reason
    s = decision.settings
    regions = guarded_regions(trainer.model)
    blocks = [r for r in regions if r.kind not in HEAD_REGIONS]
    gate = regions[0].gate if regions else None
    if gate is not None and not gate.open:
        ready = f"{len(blocks)}/{s.num_blocks} {s.block_class} blocks ready to compile"
        return False, f"{ready}; {gate.verdict}" if gate.declined else (
            f"{ready}, not compiling yet: compile.when = pays_back decides after the first {MEASURED_STEPS + 1} steps")
    fallen = [r for r in regions if r.fallback_reason]
    ok = [r for r in blocks if r.fallback_reason is None]
    how = f"{s.backend}, {s.mode or 'default'}"
    text = f"{len(ok)}/{s.num_blocks} {s.block_class} blocks compiled ({how})"
    head = [r.kind for r in regions if r.kind in HEAD_REGIONS and r.fallback_reason is None]
    if head:
        text += f" + {', '.join(head)}"
    if fallen:
        text += "; fell back to eager: " + "; ".join(f"{r.label}: {r.fallback_reason}" for r in fallen)
    if outcome.facts.get("cpu_gemm", s.cpu_gemm) == "autotune":
        text += f"; {cpu_gemm_summary()}"
    limit = _recompile_limit()
    per_kind: dict[str, int] = {}
    for r in regions:
        per_kind[r.kind] = per_kind.get(r.kind, 0) + r.compiles
    hot = sorted(k for k, n in per_kind.items() if limit and n >= limit)
    if hot:
        fix = ("set compile.dynamic: null (or true), so that new lengths share a graph" if s.dynamic is False else
               "pad batches to a multiple (data.pad_to_multiple_of) or set compile.dynamic: true")
        text += (f"; NOT ENGAGED for new shapes: {', '.join(hot)} hit torch._dynamo recompile_limit={limit}, every "
                 f"new shape after that runs eager; fix: {fix}")
    steps = steps_trained(trainer, outcome)
    idle = steps > 0 and not any(r.calls for r in blocks)
    if idle:
        text += (f"; but no block forward of {steps} training step(s) ran compiled code (the blocks are called "
                 "another way, e.g. inside a torch.compile of the whole model, which traces through them)")
    return bool(ok) and len(ok) == s.num_blocks and not fallen and not hot and not idle, text


def _recompile_limit() -> int | None:
    return compat.dynamo_recompile_limit()
