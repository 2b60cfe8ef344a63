"""The sizes a memory estimate needs, read once from a model (real or on the meta device) and its config.

Frozen and plain, like :class:`~hf_speedup.model_info.ModelInfo` (which carries it as ``shape``), so the
plan can estimate memory without touching the model again.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from torch import nn

from .blocks import block_layouts, find_blocks, unwrap_model

SMALL_PARAM = 4096  # bitsandbytes' min_8bit_size: smaller tensors keep 32-bit optimizer state


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_blocks: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    use_cache: bool  # config.use_cache: transformers builds a KV cache even in training forwards when on
    attention: str  # config._attn_implementation: sdpa | eager | flash_attention_2 | ...
    weight_bytes: int  # bytes per element of the floating weights as they are (4: fp32, 2: bf16/fp16)
    total_params: int  # every parameter once (tied weights once)
    embedding_params: int  # the input embedding
    head_params: int  # the output head (0 when tied to the input embedding)
    block_params: int  # one repeated block
    block_small_params: int  # of which in tensors under 4,096 elements (norms, biases)
    block_linears: tuple[tuple[str, int, int], ...] = ()  # (leaf name, in_features, out_features) per Linear
    # fused 3-D expert weights of a mixture-of-experts block: (block-relative name, experts, last dim, middle dim),
    # that is (in, out) for the (experts, out, in) layout of most models; GPT-OSS and Aria store them the other way
    block_experts: tuple[tuple[str, int, int, int], ...] = ()
    experts_per_token: int = 0  # config.num_experts_per_tok: the routed experts each token runs through
    # where the blocks differ (dense blocks before the experts): (count, block_linears, block_experts) per layout,
    # for the adapter count; every other figure takes the largest block for all (empty: every block alike)
    block_layouts: tuple = ()

    @property
    def expert_intermediate_size(self) -> int:
        """The width inside one expert: the narrower of its weights' sides other than hidden (stored (experts, out,
        in) by most models, (experts, in, out) by GPT-OSS and Aria; gate/up fused is 2 x wide; the width may equal
        hidden)."""
        return min((o if i == self.hidden_size else i for _, _, i, o in self.block_experts), default=0)

    @property
    def block_linear_params(self) -> int:
        return sum(i * o for _, i, o in self.block_linears)

    @property
    def other_params(self) -> int:
        """Parameters outside the blocks, embedding and head (final norm, ...)."""
        return max(0, self.total_params - self.embedding_params - self.head_params
                   - self.num_blocks * self.block_params)

    @property
    def attention_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)


def _unique_params(module: nn.Module) -> dict[int, nn.Parameter]:
    """Each parameter once, LoRA adapters left out (the estimate sizes them from the plan)."""
    out: dict[int, nn.Parameter] = {}
    for name, p in module.named_parameters():
        if "lora_" not in name:
            out.setdefault(id(p), p)
    return out


def held_weights(p, owner: nn.Module | None = None) -> int:
    """How many weights a parameter holds. bitsandbytes 4-bit packs them into the storage dtype it was loaded
    with (2 per uint8 element, 4 per bf16 one under FSDP-QLoRA); its quant state keeps the real shape, on the
    module too, where FSDP's sharding dropped it from the parameter."""
    state = getattr(p, "quant_state", None)
    if state is None:
        state = getattr(owner, "quant_state", None)
    shape = getattr(state, "shape", None)
    if shape is not None:
        return math.prod(shape)
    if type(p).__name__ == "Params4bit" or (type(owner).__name__ == "Linear4bit" and p is owner.weight):
        return p.numel() * p.element_size() * 2
    return p.numel()


def owners(module: nn.Module) -> dict[int, nn.Module]:
    """The module each parameter is registered on, by ``id`` (what :func:`held_weights` reads the quant state from)."""
    return {id(p): m for m in module.modules() for p in m.parameters(recurse=False)}


def _block_linears(block: nn.Module) -> tuple[tuple[str, int, int], ...]:
    """Every Linear of a block by its leaf name (peft's ``base_layer`` reported under its parent's name)."""
    out = []
    for name, m in block.named_modules():
        if "lora_" in name or not (isinstance(m, nn.Linear) or type(m).__name__ in ("Linear4bit", "Linear8bitLt")):
            continue
        parts = name.split(".")
        leaf = parts[-2] if parts[-1] == "base_layer" and len(parts) > 1 else parts[-1]
        out.append((leaf, int(m.in_features), int(m.out_features)))
    return tuple(out)


def model_shape(model: nn.Module) -> ModelShape | None:
    """The sizes of a transformers decoder (None where there is no config or no repeated block)."""
    base = unwrap_model(model)
    cfg = getattr(base, "config", None)
    blocks = find_blocks(model)
    if cfg is None or not blocks:
        return None
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    hidden = int(getattr(text, "hidden_size", 0) or 0)
    heads = int(getattr(text, "num_attention_heads", 0) or 0)
    if not hidden or not heads:
        return None
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    # the largest block stands for all: a mixture of experts whose first blocks are dense (DeepSeek-V3, Qwen2-MoE
    # with mlp_only_layers) or alternate (Llama 4) is sized by its expert blocks, an estimate that errs high
    first = max(blocks, key=lambda b: sum(p.numel() for p in b.parameters()))
    linears = _block_linears(first)
    inter = getattr(text, "intermediate_size", None) or max((o for _, _, o in linears), default=4 * hidden)
    params = _unique_params(model)
    owner = owners(model)

    def _numel(p) -> int:
        return held_weights(p, owner.get(id(p)))

    total = sum(_numel(p) for p in params.values())
    emb = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    emb_w = getattr(emb, "weight", None)
    head_w = getattr(head, "weight", None)
    tied = emb_w is not None and head_w is emb_w
    block = _unique_params(first)
    floating = next((p for p in params.values() if p.is_floating_point()), None)
    return ModelShape(
        hidden_size=hidden, intermediate_size=int(inter), num_blocks=len(blocks), num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads), head_dim=head_dim,
        vocab_size=int(getattr(text, "vocab_size", 0) or (emb_w.shape[0] if emb_w is not None else 0)),
        tied_embeddings=tied, use_cache=bool(getattr(text, "use_cache", False)),
        attention=str(getattr(cfg, "_attn_implementation", None) or "sdpa"),
        weight_bytes=floating.element_size() if floating is not None else 4,
        total_params=total, embedding_params=_numel(emb_w) if emb_w is not None else 0,
        head_params=0 if (tied or head_w is None) else _numel(head_w),
        block_params=sum(_numel(p) for p in block.values()),
        block_small_params=sum(_numel(p) for p in block.values() if p.numel() < SMALL_PARAM),
        block_linears=linears, block_experts=_block_experts(first),
        experts_per_token=int(getattr(text, "num_experts_per_tok", 0) or 0), block_layouts=_layouts(blocks),
    )


def _layouts(blocks) -> tuple:
    """(count, block_linears, block_experts) per distinct block layout, where there is more than one."""
    layouts = block_layouts(blocks)
    if len(layouts) < 2:
        return ()
    return tuple((count, _block_linears(b), _block_experts(b)) for count, b in layouts)


def _block_experts(block: nn.Module) -> tuple[tuple[str, int, int, int], ...]:
    """transformers 5 stores experts as (experts, out, in) parameters beside the Linears (peft's wrapper, once
    adapted, moves them under ``base_layer``)."""
    shapes = {".".join(part for part in n.split(".") if part != "base_layer"): p.shape
              for n, p in block.named_parameters() if p.dim() == 3}
    return tuple((n, int(s[0]), int(s[2]), int(s[1])) for n, s in shapes.items())
