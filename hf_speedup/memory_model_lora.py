"""The LoRA terms of the memory model (:mod:`hf_speedup.memory_model` has the terms' definitions): which Linears of
a block are adapted and what peft's path keeps of them and holds for a moment, forward and backward."""

from __future__ import annotations

from .memory_model_types import LoraShape, TrainingSetup
from .model_shape import ModelShape

ATTN_ROLE = {"q_proj": "norm1", "k_proj": "norm1", "v_proj": "norm1", "qkv_proj": "norm1", "query_key_value": "norm1",
             "o_proj": "attn", "out_proj": "attn", "dense": "attn", "gate_proj": "norm2", "up_proj": "norm2",
             "gate_up_proj": "norm2", "down_proj": "mlp", "fc1": "norm2", "fc2": "mlp"}


def _roles(shape: ModelShape) -> list[tuple[str, int, str]]:
    """(leaf name, in_features, input it reads: norm1 | attn | norm2 | mlp) per Linear of a block."""
    out = []
    for name, d_in, _ in shape.block_linears:
        role = ATTN_ROLE.get(name) or ("mlp" if d_in == shape.intermediate_size else "norm1")
        out.append((name, d_in, role))
    return out


def lora_parameters(shape: ModelShape, lora: LoraShape) -> int:
    """Adapter parameters over every block: ``rank x (in + out)`` per adapted Linear, and one such pair per expert
    of an adapted fused expert weight (peft's ParamWrapper: lora_A ``(rank x experts, in)``)."""
    layouts = shape.block_layouts or ((shape.num_blocks, shape.block_linears, shape.block_experts),)
    total = 0
    for count, block_linears, block_experts in layouts:
        linears = sum(lora.rank * (i + o) for n, i, o in block_linears
                      if lora.targets == "all-linear" or n in lora.targets)
        experts = sum(lora.rank * e * (i + o) for n, e, i, o in block_experts if lora.expert_targets == "all" or
                      any(n == t or n.endswith("." + t) for t in lora.expert_targets))
        total += count * (linears + experts)
    return total


def _adapted(shape: ModelShape, lora: LoraShape) -> list[tuple[str, int, int, str]]:
    """(name, in, out, role) of the block Linears carrying an adapter."""
    roles = {n: role for n, _, role in _roles(shape)}
    targets = lora.targets
    return [(n, i, o, roles[n]) for n, i, o in shape.block_linears
            if targets == "all-linear" or n in targets]


def _saved_lora(shape: ModelShape, st: TrainingSetup, c: int, roles: tuple[str, ...] | None = None) -> float:
    """Per token: what peft's LoRA path keeps per adapted Linear of one block (adapters are fp32: peft casts
    their input to fp32 first; on CPU dropout keeps its mask in that dtype, on CUDA as bool); ``roles``: only the
    Linears reading those inputs."""
    mask = 1 if st.device == "cuda" else 4
    total = 0.0
    shared: set[str] = set()
    for _, d_in, _, role in _adapted(shape, st.lora):
        if roles is not None and role not in roles:
            continue
        if st.lora.dropout > 0:
            total += mask * d_in + (c if st.autocasts else 4) * d_in  # dropout mask + lora_A's input
        elif st.autocasts:
            total += c * d_in  # autocast casts lora_A's (fp32) input at every call, over a 16-bit base too
        elif st.residual_bytes != 4:
            total += 4 * d_in  # the fp32 copy peft makes of a 16-bit input, per adapter
        elif role not in shared and role != "attn":  # shared input; SDPA keeps the attention output already
            shared.add(role)
            total += 4 * d_in
        total += c * st.lora.rank  # lora_A's output, kept by lora_B
    return total


def _lora_transient(shape: ModelShape, st: TrainingSetup, tokens: int, tile: int) -> float:
    """The largest adapter input peft holds for a moment beyond what is saved, in a block's (re)computed forward: its
    fp32 copy of a 16-bit input and dropout's fp32 output, per token of the sequence (of the tile for the MLP's)."""
    if st.lora is None:
        return 0.0
    per = (4 if st.residual_bytes != 4 else 0) + (4 if st.lora.dropout > 0 else 0)
    return max((per * d_in * (tile if role in ("norm2", "mlp") else tokens)
                for _, d_in, _, role in _adapted(shape, st.lora)), default=0.0)


def _lora_grad_transient(shape: ModelShape, st: TrainingSetup, tokens: int, tile: int) -> float:
    """In a block's backward, beside its gradients: the fp32 gradient of peft's fp32 copy of a 16-bit input (lora_A
    computes in fp32), the largest adapted input's, before it is cast back and added to the input's gradient; with
    dropout, the gradient of dropout's output beside it (both fp32)."""
    if st.lora is None or st.residual_bytes == 4:
        return 0.0
    per = 4 + (4 if st.lora.dropout > 0 else 0)
    return max((per * d_in * (tile if role in ("norm2", "mlp") else tokens)
                for _, d_in, _, role in _adapted(shape, st.lora)), default=0.0)
