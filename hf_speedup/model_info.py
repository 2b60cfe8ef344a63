"""A plain, frozen description of a model, so the plan can reason about it without touching it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .blocks import block_class_names, block_layouts, find_blocks, unwrap_model
from .dtypes import long_name
from .model_parts import (attention_softcap, expert_parameters, experts_implementation, experts_modules, head_kind,
                          head_modules, loss_takes_own_mean, miscounted_loss, routers, value_head_dim)
from .model_shape import ModelShape, held_weights, model_shape, owners


@dataclass(frozen=True)
class ModelInfo:
    architecture: str = "unknown"
    model_type: str = "unknown"
    block_class: str | None = None  # the first block class in forward order
    num_blocks: int = 0
    # every block class, in forward order (a vision-language model has a vision and a text block); FSDP wraps all
    block_classes: tuple[str, ...] = ()
    hidden_size: int | None = None
    num_layers: int | None = None
    vocab_size: int | None = None
    total_parameters: int = 0
    trainable_parameters: int = 0
    embedding_parameters: int = 0
    dtype: str = "float32"
    is_peft: bool = False
    quantization: str | None = None  # "4bit" | "8bit" | "gguf" | other quantizer name | None
    linear_names: tuple[str, ...] = ()  # leaf names of the linear layers inside blocks, routers left out (LoRA targets)
    expert_parameters: tuple[str, ...] = ()  # block-relative fused 3-D expert weights (mlp.experts.gate_up_proj)
    routers: tuple[str, ...] = ()  # block-relative routers of a mixture-of-experts block (mlp.gate)
    experts_modules: int = 0  # experts modules dispatching through transformers' ExpertsInterface (switchable)
    experts_implementation: str | None = None  # their config._experts_implementation (eager, grouped_mm, ...)
    head: str = "none"  # the task head (model_parts.head_kind): causal_lm, masked_lm, sequence_classification, ...
    head_modules: tuple[str, ...] = ()  # top-level modules outside the backbone (score, classifier, lm_head)
    miscounted_loss: str = ""  # why the stock Trainer's padded loss is not the mean over the real targets
    loss_own_mean: str = ""  # why the Trainer's token-count scaling is wrong for this head (model_parts)
    attn_implementation: str | None = None  # config._attn_implementation of the live model
    attention_kernels: tuple[str, ...] = ()  # what the class declares: sdpa, flash_attention, flex_attention, interface
    packed_sequences: bool = False  # padding-free rows (position_ids restarting per sequence) are kept apart
    packed_reason: str = ""
    sliding_window: int | None = None  # attention limited to the last N tokens in some or all layers
    attention_softcap: float | None = None  # attention logits squashed by cap*tanh(s/cap) (Gemma 2): not SDPA's math
    value_head_dim: int | None = None  # where values are narrower than queries/keys (DeepSeek's latent attention)
    shape: ModelShape | None = None  # the sizes memory estimates need (memory_model)
    compiled_whole: bool = False  # the caller already compiled the whole model (torch.compile(model), model.compile())
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def quantization_of(model: nn.Module) -> str | None:
    """How the weights are quantized, as the Trainer sees it (``hf_quantizer``/flags on the HF model)."""
    base = unwrap_model(model)
    if getattr(base, "is_loaded_in_4bit", False):
        return "4bit"
    if getattr(base, "is_loaded_in_8bit", False):
        return "8bit"
    q = getattr(base, "hf_quantizer", None)
    if q is not None:
        method = getattr(getattr(q, "quantization_config", None), "quant_method", None)
        return str(getattr(method, "value", method) or type(q).__name__)
    cfg = getattr(base, "config", None)
    qc = getattr(cfg, "quantization_config", None) if cfg is not None else None
    if qc:
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        return str(getattr(method, "value", method) or "quantized")
    return None


# Layers peft's LoRA adapts as linear: nn.Linear, transformers' Conv1D (GPT-2's projections: a Linear with
# transposed weight) and the bitsandbytes k-bit Linears.
LINEAR_LAYER_CLASSES = ("Linear4bit", "Linear8bitLt", "Conv1D")


def is_linear_layer(m: nn.Module) -> bool:
    """A layer LoRA can adapt as a linear projection (see ``LINEAR_LAYER_CLASSES``)."""
    return isinstance(m, nn.Linear) or type(m).__name__ in LINEAR_LAYER_CLASSES


@dataclass(frozen=True)
class ParamCounts:
    total: int  # every parameter, once (tied weights once; 4-bit packed weights unpacked)
    trainable: int
    matmul_trainable: int  # non-embedding parameters with requires_grad
    matmul_frozen: int  # non-embedding parameters without requires_grad
    embedding: int  # lookup-only parameters (nn.Embedding weights not reused as a matmul weight)

    def to_dict(self) -> dict:
        return asdict(self)


def parameter_counts(model) -> ParamCounts:
    """Parameter counts of the live model, split the way the FLOPs formula needs them."""
    params = {}
    for p in model.parameters():
        params.setdefault(id(p), p)
    used_as_matmul: set[int] = set()
    lookup: set[int] = set()
    for m in model.modules():
        w = getattr(m, "weight", None)
        if not isinstance(w, nn.Parameter):
            continue
        if isinstance(m, nn.Embedding):
            lookup.add(id(w))
        else:
            used_as_matmul.add(id(w))
    lookup_only = lookup - used_as_matmul
    owner = owners(model)
    total = trainable = mm_train = mm_frozen = emb = 0
    for pid, p in params.items():
        n = held_weights(p, owner.get(id(p)))
        total += n
        if p.requires_grad:
            trainable += n
        if pid in lookup_only:
            emb += n
        elif p.requires_grad:
            mm_train += n
        else:
            mm_frozen += n
    return ParamCounts(total=total, trainable=trainable, matmul_trainable=mm_train, matmul_frozen=mm_frozen,
                       embedding=emb)


def attention_facts(model: nn.Module) -> dict:
    """The attention kernel in use, the kernels the class can switch to, and whether padding-free rows work.

    Packed sequences are kept apart where the modeling code builds its masks with transformers'
    ``create_causal_mask`` (it detects restarting ``position_ids``) and dispatches attention through
    ``AttentionInterface`` (flash kernels take ``cu_seqlens`` from the same position ids).
    """
    import sys

    base = unwrap_model(model)
    cfg = getattr(base, "config", None)
    impl = getattr(cfg, "_attn_implementation", None) if cfg is not None else None
    cls = type(base)
    kernels = [name for flag, name in (("_supports_sdpa", "sdpa"), ("_supports_flash_attn", "flash_attention"),
                                       ("_supports_flex_attn", "flex_attention")) if getattr(cls, flag, False)]
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    try:
        interface = bool(can_set()) if callable(can_set) else False
    except Exception:  # a heuristic over the module source; never fatal
        interface = False
    if interface:
        kernels.append("interface")
    module = sys.modules.get(cls.__module__)
    masks = module is not None and hasattr(module, "create_causal_mask")
    decoder = cfg is not None and not getattr(cfg, "is_encoder_decoder", False) and not _bidirectional(cfg)
    causal_head = cls.__name__.endswith(("ForCausalLM", "LMHeadModel"))
    if not decoder:
        packed, why = False, f"{cls.__name__} is not a decoder-only model"
    elif not causal_head:
        packed, why = False, (f"{cls.__name__} has no causal-LM head: its labels are not per-token (a classification "
                              "or other head keeps its rows padded)")
    elif not (masks and interface):
        packed, why = False, (f"{cls.__name__}'s modeling code does not build its masks with transformers' "
                              "create_causal_mask through AttentionInterface, so packed sequences would attend to "
                              "each other")
    else:
        packed, why = True, (f"{cls.__name__} builds masks with create_causal_mask (sequences found from restarting "
                             "position_ids) and dispatches attention through AttentionInterface")
    return {"attn_implementation": impl, "attention_kernels": tuple(kernels), "packed_sequences": packed,
            "packed_reason": why, "sliding_window": _sliding_window(cfg), "attention_softcap": attention_softcap(cfg),
            "value_head_dim": value_head_dim(cfg)}


def _sliding_window(cfg) -> int | None:
    """The window of the layers that use one (Mistral, Gemma 2/3, Qwen2 with use_sliding_window), else None."""
    text = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    window = getattr(text, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return None
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    return window if getattr(text, "use_sliding_window", True) else None


def _bidirectional(cfg) -> bool:
    """An encoder family (BERT, RoBERTa, ...) used as an encoder: its self-attention sees the whole row."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    return getattr(cfg, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(cfg, "is_decoder", False)


def _compiled_whole(model: nn.Module) -> bool:
    """``torch.compile(model)`` (an OptimizedModule around ``_orig_mod``) or ``model.compile()`` (the root's
    ``_compiled_call_impl``), under peft/DDP wrappers too."""
    for m in (model, unwrap_model(model)):
        if hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None:
            return True
    return False


def _block_parts(blocks) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """Linear leaf names (routers left out), fused expert weights and routers over every block layout: the first
    block alone would miss the experts of a mixture that begins with dense blocks."""
    linear_names: list[str] = []
    experts: list[str] = []
    found_routers: list[str] = []
    for _, b in block_layouts(blocks):
        block_routers = routers(b)
        found_routers += [r for r in block_routers if r not in found_routers]
        experts += [e for e in expert_parameters(b) if e not in experts]
        for name, m in b.named_modules():
            in_router = any(name == r or name.startswith(r + ".") for r in block_routers)
            if is_linear_layer(m) and not in_router:
                leaf = name.split(".")[-1]
                if leaf and leaf not in linear_names and leaf not in ("base_layer",):
                    linear_names.append(leaf)
    return tuple(linear_names), tuple(experts), tuple(found_routers)


def describe_model(model: nn.Module) -> ModelInfo:
    cfg = getattr(model, "config", None)
    text_cfg = cfg.get_text_config() if cfg is not None and hasattr(cfg, "get_text_config") else cfg
    blocks = find_blocks(model)
    names = block_class_names(model)
    counts = parameter_counts(model)
    emb = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    linear_names, experts, block_routers = _block_parts(blocks)
    dtype = next((long_name(p.dtype) for p in model.parameters() if p.is_floating_point()), "float32")
    return ModelInfo(
        architecture=type(unwrap_model(model)).__name__,
        model_type=str(getattr(cfg, "model_type", "unknown")),
        block_class=names[0] if names else None,
        num_blocks=len(blocks),
        block_classes=tuple(names),
        hidden_size=getattr(text_cfg, "hidden_size", None),
        num_layers=getattr(text_cfg, "num_hidden_layers", None),
        vocab_size=getattr(text_cfg, "vocab_size", None),
        total_parameters=counts.total,
        trainable_parameters=counts.trainable,
        embedding_parameters=emb,
        dtype=dtype,
        is_peft=hasattr(model, "peft_config"),
        compiled_whole=_compiled_whole(model),
        quantization=quantization_of(model),
        linear_names=tuple(linear_names),
        expert_parameters=experts,
        routers=block_routers,
        experts_modules=len(experts_modules(model)),
        experts_implementation=experts_implementation(model),
        head=head_kind(unwrap_model(model)),
        head_modules=head_modules(unwrap_model(model)),
        miscounted_loss=miscounted_loss(unwrap_model(model)),
        loss_own_mean=loss_takes_own_mean(unwrap_model(model)),
        **attention_facts(model),
        shape=model_shape(model),
    )
