"""The compile decision: on or off, and the concrete torch.compile parameters, with the reason (plan time, pure).

Reads config, capabilities, model info and the decisions before it (data's padding-free rows make the sequence
dimension dynamic; LoRA on fused expert weights keeps compile off); nothing here touches a model.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from ...plan_types import OFF, Decision, PlanContext
from ..deepspeed import adapted, zero_stage
from .payback import PAYBACK, compile_cost_text, figures

NAME = "compile"


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
    when: str = "always"  # always | pays_back (the first steps eager, compiled only if it earns back; payback.py)
    cache_dir: str = "auto"  # auto | none | a folder: where the compile cache is saved and loaded from (cache.py)


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
                        num_blocks=getattr(info, "num_blocks", 0), when=_when(cfg.when, caps),
                        cache_dir=_cache_dir(cfg.cache_dir))
    explicit = requested is True
    if requested is False:
        return _off(requested, "compile.enabled = false", settings)
    if zero_stage(ctx) == 3:
        why = adapted(ctx, "compile.enabled", requested, "ZeRO-3 gathers each block's parameters in module hooks, which "
                      "regional compile would trace into and recompile at every gather (ZeRO-1/2 leave the modules "
                      "alone and compile as usual); the blocks run eager", "compile.enabled: false, or ZeRO stage 2")
        return _off(requested, why, settings, [f"compile: {why}"] if explicit else [])
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
        # see _on_reason: a preset's max-autotune becomes default, the user's own keeps its GEMM autotuning
        users_mode = "compile.mode" in ctx.config.explicit_fields()
        settings = replace(settings, mode=NO_CUDAGRAPHS if users_mode else "default")
    autotune = _autotunes_cpu_gemms(cfg, caps) and settings.dynamic is not True
    settings = replace(settings, cpu_gemm="autotune" if autotune else "default")
    return Decision(NAME, requested=requested, applied=f"{cfg.regions}:{cfg.backend}",
                    reason=_on_reason(ctx, settings), settings=settings)


NO_CUDAGRAPHS = "max-autotune-no-cudagraphs"
AUTOTUNE_COLD_S = 150  # max-autotune-no-cudagraphs, dynamic, Llama-3.2-1B shape, H200: not done after 150 s


def _when(asked: str, caps) -> str:
    """``pays_back`` only where the payback constants were measured and one process decides alone."""
    return "pays_back" if asked == "pays_back" and caps.device_type in PAYBACK and not caps.distributed else "always"


def _cache_dir(asked) -> str:
    """``compile.cache_dir`` as the settings carry it: ``auto``, ``none`` (also for null) or the folder's path."""
    return "none" if asked is None or asked == "none" else str(asked)


def _cache_reason(s: Settings) -> str:
    if s.cache_dir == "none":
        return ""
    where = "" if s.cache_dir == "auto" else f" and in {s.cache_dir} (loaded from there by a fresh run)"
    return (f"compile cache: the compiled graphs and kernels saved beside each checkpoint{where}, loaded before a "
            "resumed run's first compile (compile.cache_dir: none turns it off)")


def _when_reason(asked: str, s: Settings, caps) -> str:
    if asked != "pays_back":
        return ""
    if s.when == "pays_back":
        gain, _, _, source = figures(caps)
        return (f"compile.when = pays_back: the first steps run eager and are timed; the blocks compile only if the "
                f"remaining eager time x {gain:.0%} (what compiled blocks save on {caps.device_type}) exceeds "
                f"{compile_cost_text(caps, s.dynamic is not True)} ({source})")
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
    if cache := _cache_reason(s):
        parts.append(cache)
    if s.mode == NO_CUDAGRAPHS and ctx.config.compile.mode == "max-autotune":
        parts.append("max-autotune without CUDA graphs: with a dynamic sequence dimension inductor would record "
                     "new graphs for every length seen, their memory pool growing step after step")
    if s.mode == "default" and ctx.config.compile.mode == "max-autotune":
        parts.append(f"mode default, not the preset's max-autotune: with a dynamic sequence dimension CUDA graphs "
                     f"are off and GEMM autotuning tunes for one length, yet it cost over {AUTOTUNE_COLD_S} s of cold "
                     f"compile on a 1B Llama's 16 blocks (H200; 16 stock steps took 5 s); set compile.mode: "
                     f"max-autotune-no-cudagraphs to autotune anyway")
    if _padding_free(ctx):
        parts.append(f"padding-free rows change length every step: the sequence dimension is compiled dynamic "
                     f"(dynamic={ctx.config.compile.dynamic} asked), one graph for every length instead of a "
                     "recompile per length; measured faster than bucketing row lengths (benchmarks/RESULTS.md)")
        if _autotunes_cpu_gemms(ctx.config.compile, ctx.caps):
            parts.append("CPU GEMM autotune off: symbolic GEMM sizes have no single shape to time")
    elif s.dynamic is False and not ctx.config.data.pad_to_multiple_of:
        parts.append("dynamic=False without data.pad_to_multiple_of: each new sequence length recompiles "
                     "(after torch._dynamo's recompile_limit that region runs eager)")
    experts = ctx.decisions.get("experts")
    kernel = (experts.settings.implementation or experts.settings.previous) if experts is not None else None
    if kernel == "eager" and getattr(ctx.model, "experts_modules", 0):
        parts.append("the experts' per-expert loop breaks each MoE block's graph where it finds the experts hit "
                     "(a data-dependent nonzero): the block runs as several graphs with the loop eager between them "
                     "(grouped_mm and batched_mm trace whole, no recompile per routing: benchmarks/bench_moe.py)")
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


def changes_model(decision: Decision, plan) -> bool:
    """Whether SpeedupTrainer would compile the model (what ``training_arguments()`` tells a stock-Trainer user it
    drops). Planned without a model, regional compile reads "no block found"; what it would do for a model with
    blocks is what the config asks."""
    if decision.active:
        return True
    asked = plan.config.compile.enabled
    return asked is True or (asked == "auto" and plan.caps.is_cuda)
