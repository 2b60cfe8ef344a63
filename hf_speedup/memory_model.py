"""Memory of one steady-state training step, from sizes and settings alone (no weights, no device).

The formulas behind :func:`hf_speedup.estimate_memory` and ``memory.budget``. The result is the peak of
live tensor bytes (what torch's ``MemTracker`` counts, and ``torch.cuda.max_memory_allocated`` on a GPU)
plus a fixed overhead (the CUDA context), broken down into what is alive at that peak.

Notation, per micro-batch: ``N = micro_batch x seq_len`` tokens, ``S`` the sequence length, ``h`` the
hidden size, ``i`` the MLP width, ``qw = heads x head_dim``, ``kv = kv_heads x head_dim``, ``nq`` heads,
``V`` the vocabulary, ``L`` blocks, ``P`` parameters, ``T`` trainable parameters. ``r`` is the bytes per
element of the weights (and of the residual stream, which has their dtype), ``c`` of the compute dtype (2
under bf16/fp16 autocast or with 16-bit weights, else 4); *cast* means autocast over wider weights (r > c).

Persistent (sources: ZeRO, Rajbhandari et al. 2020, sec. 3; bitsandbytes 8-bit optimizers, Dettmers et
al. 2022; QLoRA, Dettmers et al. 2023):

- weights ``P.r``; QLoRA: block Linear weights in NF4 with double-quantized constants, 4.127 bits each,
  the rest fp32 (peft's ``prepare_model_for_kbit_training`` upcasts every non-quantized parameter);
- gradients ``T.r`` (the trainable weights' dtype), alive from their block's backward to ``zero_grad``,
  and all the time with gradient accumulation > 1;
- AdamW states ``2.T.r``; 8-bit AdamW ``2 + 8/256`` bytes per element (two uint8 states, an fp32 absmax
  per 256-element block), 32-bit states (8 bytes) for tensors under 4,096 elements and for embeddings
  (transformers registers that override); paged states live in CUDA unified memory (outside
  ``max_memory_allocated``) but count here: that is where they are unless memory runs short;
- LoRA adapters ``rank x (in + out)`` per adapted Linear, fp32 (peft keeps adapters in fp32), with their
  gradients and AdamW states: 16 bytes per adapter parameter, of which the gradients (4) exist only from
  their block's backward to ``zero_grad`` (which sets them to None), as the base's gradients do;
- autocast weight copies: every matmul weight cast to ``c`` once per forward and saved for backward,
  ``2.P_matmul`` bytes, freed block by block during backward; under autocast over a 16-bit base, the fp32
  adapters' copies ``c`` per adapter parameter (autocast caches the casts of trainable leaves);
- FSDP divides weights, gradients and states by the shard group (``shard_grad_op`` keeps weights whole
  between forward and backward) and adds two gathered blocks in flight; gathered in the compute dtype (a
  mixed-precision policy), the blocks need no autocast copies; CPU offload moves all three off the device.

Saved activations per token (autograd keeps what each op's backward needs: PyTorch
``tools/autograd/derivatives.yaml``; the structure follows Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", for a Llama-style block: RMSNorm, q/k/v/o,
gated MLP). Per block, each term checked tensor by tensor against ``MemTracker`` (torch 2.13,
transformers 5.23, see ``benchmarks/RESULTS.md``):

- each RMSNorm: ``4`` (rsqrt), its input in fp32 ``4h``, ``r.h`` for ``x*rsqrt`` where the norm weight trains.
  The fp32 input is the residual stream itself (block input, residual after attention) over fp32 weights, and
  a copy over 16-bit ones, whose 16-bit residuals are then kept by nothing (the residual adds save no input):
  the residual stream is counted here, once; the embedding output is block 0's input, kept by its first norm
  or its checkpoint;
- norm outputs kept by trainable projections: ``r.h`` once per norm, or under autocast one ``c.h`` copy per
  projection (autocast casts each Linear's input separately: 3 for q/k/v, 2 for gate/up);
- attention, SDPA/flash: q ``c.qw``, k and v ``c.kv`` each, the output ``c.qw`` (o_proj reads it as a
  view), the log-sum-exp ``4.nq``; with a padding mask K/V are repeated to every head (``c.qw`` each) and
  a float mask ``4.S`` is kept per block; eager: q, repeated k and v and the output as ``c.qw`` copies,
  softmax probabilities ``4.nq.S`` (plus a ``c`` copy under autocast);
- MLP: gate, act(gate), up ``3.c.i``, and the product ``c.i`` where down_proj trains;
- routed experts, per (token, routed expert) pair with ``I`` the expert width, by transformers' experts
  implementation (``config._experts_implementation``; saved tensors counted per kernel with
  ``saved_tensors_hooks``, transformers 5.24): the loop (``eager``) keeps its gathered input, the gate/up output
  and act(gate), down_proj's input, its output and its weighted output, ``c.(4I + 3h)``; ``grouped_mm`` the
  sorted input and the same MLP tensors, ``c.(4I + 2h)``; ``batched_mm`` ``c.(3I + h)`` plus both expert weights
  gathered for every pair, ``c.3.I.h``, and in the block's backward the gate/up weights' gradient ``c.2.I.h`` after
  down_proj's ``c.I.h`` are freed;
- LoRA, per adapted Linear: the dropout mask (fp32 on CPU, bool on CUDA) and output (``4.d_in``, or under
  autocast, over a 16-bit base too, the copy ``c.d_in`` that lora_A casts peft's fp32 input to: the fp32 one
  is then freed), ``c.rank`` for lora_A's output; frozen base weights keep none of the above that
  only their own gradient needed (no norm ``x*rsqrt``, no projection inputs);
- a compiled block (AOT autograd's min-cut partition, inductor or aot_eager, from the first step; dense blocks
  that train), checked tensor by tensor with torch 2.13's CPU inductor in fp32 and under bf16 autocast: its input
  ``r.h``, each norm's rsqrt ``4`` and one output in the compute dtype ``c.h`` (the casts are shared), q, k, v,
  the attention output and log-sum-exp as above plus o_proj's contiguous input ``c.qw``, and gate, up and their
  product ``3.c.i``; the residual after attention and act(gate) are recomputed in backward;
- a checkpointed block keeps its input only (``r.h``) and recomputes the rest in backward; offloaded to host
  memory (``checkpointing.offload``, CUDA), the inputs leave the device, one prefetched back during backward; the
  final norm (its fp32 input: the last block's output) and, where lm_head trains, its input;
- a tiled MLP (``tiled_mlp``: the dense MLP over tiles of the sequence, each recomputed in backward) keeps its
  input ``r.h`` for the tiles, and its own share above (gate, act(gate), up, their product, the inputs of
  gate/up and their adapters) and its two backward gradients ``2.c.i`` for one tile of ``min(tile, N)`` tokens;
- a KV cache: transformers builds one in training forwards when ``config.use_cache`` is on; under autocast
  it holds fp32 K/V copies (``2.r.kv`` per block) until the forward returns.

Logits and loss (transformers' ``ForCausalLMLoss`` upcasts the logits to fp32): forward ``(c + 4)``
bytes per logit, ``+4`` for the fp32 copy under autocast; backward ``12`` (log-softmax output, its gradient,
the logits' gradient). Chunked (``loss.chunked``): the full logits never exist: one chunk's ``chunk_tokens x V``
fp32 logits beside the ``c``-byte matmul output they upcast, ``(4 + c)`` bytes per logit (4 in fp32; log-sum-exp
and softmax - onehot run in their storage), plus a saved copy of the hidden states and its gradient. Checked also
against the allocator's own events (torch.profiler): MemTracker misses a kernel's internal temporaries.

Backward temporaries of one block: the residual gradient ``r.h`` and two MLP gradients ``2.c.i`` per token, with,
under LoRA over a 16-bit base, the fp32 gradient of peft's fp32 copy of the largest adapted input (``4.d_in``, and
``4.d_in`` more for dropout's output gradient), or, in
its (re)computed forward, the largest adapter input peft holds beyond what is saved (its fp32 copy of a 16-bit
input ``4.d_in``, dropout's fp32 output ``4.d_in``), whichever is more; a checkpointed block's recompute also holds
its 16-bit input (its checkpoint's) beside the norm's fp32 copy.

The peak is the largest of: the end of the forward (loss computed), the loss backward, the backward of
each block (earlier blocks' activations alive, later blocks' gradients done), and the optimizer step.
"""

from __future__ import annotations

from .model_shape import SMALL_PARAM, ModelShape
from .memory_model_lora import (ATTN_ROLE, _lora_grad_transient, _lora_transient, _roles, _saved_lora,
                                lora_parameters)
from .memory_model_types import (EXPERTS_MODELLED, ITEM_TEXT, ITEMS, OPTIMIZERS, LoraShape, MemoryEstimate,
                                 MlpTiles, TrainingSetup, fmt_bytes, setup_notes)

__all__ = ["ADAPTER_BYTES", "ATTN_ROLE", "BNB_8BIT_BYTES", "CUDA_CONTEXT", "EXPERTS_MODELLED", "GiB", "ITEMS",
           "ITEM_TEXT", "LoraShape", "MemoryEstimate", "MlpTiles", "NF4_BYTES", "OPTIMIZERS", "TrainingSetup",
           "block_saved_per_token", "estimate", "fmt_bytes", "lora_parameters", "mlp_saved_per_token"]

GiB = 1024 ** 3
NF4_BYTES = 4.127 / 8  # NF4 + double-quantized constants (QLoRA paper: 0.127 bits per parameter)
BNB_8BIT_BYTES = 2 + 2 * 4 / 256  # two uint8 states + an fp32 absmax per 256-element block each
CUDA_CONTEXT = 512 * 1024 ** 2  # CUDA context and kernels: outside max_memory_allocated, inside the device
BLOCKED_QUERIES = 128  # queries per block of the blocked CPU attention kernel (features/attention/blocked.py)
ADAPTER_BYTES = 4 + 4 + 8  # fp32 adapter weight, gradient, two AdamW states

# --------------------------------------------------------------------------------------------- helpers
def _saved_attention(shape: ModelShape, st: TrainingSetup, c: int) -> float:
    qw, kv, nq, S = shape.attention_width, shape.kv_width, shape.num_heads, st.seq_len
    if st.attention == "eager":
        probs = 4 * nq * S + (c * nq * S if c != 4 else 0)
        return 4 * c * qw + probs  # q, repeated k and v, output as copies; softmax probabilities
    kv_kept = qw if (st.padded and kv != qw) else kv
    mask = 4 * S if st.padded else 0
    return 2 * c * qw + 2 * c * kv_kept + 4 * nq + mask


def blocked_attention_tiled(head_dim: int, c: int) -> bool:
    """Whether the ``blocked`` kernel can run its tiled form: bf16 on AMX, whole vectors per head (the rule
    ``blocked.can_tile`` applies to a call, read here without building the kernel)."""
    import torch

    try:
        amx = bool(torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        amx = False
    return amx and c == 2 and head_dim % 16 == 0


def _blocked_attention_backward(shape: ModelShape, st: TrainingSetup, c: int) -> float:
    """The ``blocked`` CPU kernel's backward working set. The bmm form: one block of queries' scores, their
    gradient, the probabilities and their gradient against every key of a row (4 tensors of heads x
    BLOCKED_QUERIES x row length). The tiled form: fp32 key/value gradients per part of a key/value head's query
    tiles (at most one part per query head; summed at the end) and the keys and values packed three ways. Both: fp32 key/value gradient accumulators."""
    if st.attention != "blocked":
        return 0.0
    if blocked_attention_tiled(shape.head_dim, c) and st.attention_form != "bmm":
        return 2 * 4 * shape.attention_width * st.tokens + 3 * c * shape.kv_width * st.tokens + \
            2 * 4 * shape.kv_width * st.tokens
    rows = 4 * c * shape.num_heads * min(BLOCKED_QUERIES, st.seq_len) * st.seq_len
    return rows + 2 * 4 * shape.kv_width * st.tokens


def block_saved_per_token(shape: ModelShape, st: TrainingSetup) -> float:
    """Bytes per token one (not checkpointed) block keeps for backward, its output included."""
    h, i = shape.hidden_size, shape.intermediate_size
    r, c, cast = st.residual_bytes, st.compute_bytes, st.cast
    trains = st.lora is None
    if compiled_partition(shape, st):
        return r * h + 2 * (4 + c * h) + _saved_attention(shape, st, c) + c * shape.attention_width + 3 * c * i
    # the residual stream (block input, residual after attention) is what each norm keeps as its fp32 input: the
    # tensor itself in fp32, a copy over 16-bit weights (whose 16-bit residuals are then freed); + rsqrt, x*rsqrt
    total = 2 * norm_saved_per_token(shape, st)
    if trains:
        roles = [role for _, _, role in _roles(shape)]
        for group in ("norm1", "norm2"):
            n = max(1, roles.count(group))
            total += (n * c if cast else r) * h
    total += _saved_attention(shape, st, c)
    if shape.experts_per_token and shape.expert_intermediate_size:
        total += shape.experts_per_token * _saved_per_pair(shape, st.experts, c)
        # a shared expert (Qwen2-MoE): an MLP of Linears beside the routed experts, run for every token
        shared = next((d_in for n, d_in, d_out in shape.block_linears if d_out == h and ATTN_ROLE.get(n) == "mlp"), 0)
        total += 3 * c * shared + (c * shared if trains else 0)
    else:
        total += 3 * c * i + (c * i if trains else 0)
    if st.lora is not None:
        total += _saved_lora(shape, st, c)
    return total


def mlp_saved_per_token(shape: ModelShape, st: TrainingSetup) -> float:
    """The dense MLP's share of :func:`block_saved_per_token` (gate, act(gate), up, the product where down_proj
    trains, gate/up's inputs where they train, the adapters of gate/up/down): what a tiled MLP keeps for one tile at
    a time; 0 for routed experts (not tiled) and compiled blocks (not modelled tiled)."""
    if shape.experts_per_token or compiled_partition(shape, st):
        return 0.0
    h, i, c = shape.hidden_size, shape.intermediate_size, st.compute_bytes
    if st.lora is not None:
        return 3 * c * i + _saved_lora(shape, st, c, roles=("norm2", "mlp"))
    n = max(1, [role for _, _, role in _roles(shape)].count("norm2"))
    return 4 * c * i + (n * c if st.cast else st.residual_bytes) * h


def norm_saved_per_token(shape: ModelShape, st: TrainingSetup) -> float:
    """What one RMSNorm keeps per token: rsqrt ``4``, its input in fp32 ``4h``, ``x*rsqrt`` where its weight trains."""
    h = shape.hidden_size
    return 4 + 4 * h + (st.residual_bytes * h if st.lora is None else 0)


def compiled_partition(shape: ModelShape, st: TrainingSetup) -> bool:
    """The compiled block's saved set is modelled (dense, trained in full, SDPA-style attention); else eager's."""
    return st.compiled and st.lora is None and not shape.experts_per_token and st.attention != "eager"


def _saved_per_pair(shape: ModelShape, kernel: str, c: int) -> float:
    """Bytes one (token, routed expert) pair keeps for backward under the experts implementation ``kernel``."""
    h, i = shape.hidden_size, shape.expert_intermediate_size
    if kernel == "grouped_mm":
        return c * (4 * i + 2 * h)
    if kernel == "batched_mm":
        return c * (3 * i + h) + _gathered_per_pair(shape, c)
    return c * (4 * i + 3 * h)  # the loop (and any implementation not modelled: see the notes)


def _gathered_per_pair(shape: ModelShape, c: int) -> float:
    """batched_mm's copy of both expert weights (gate/up 2I x h, down h x I) for one (token, expert) pair."""
    return c * 3 * shape.expert_intermediate_size * shape.hidden_size


def _param_items(shape: ModelShape, st: TrainingSetup) -> dict:
    """Weights, gradients, optimizer states, adapters and autocast copies: total and per part."""
    L, r = shape.num_blocks, st.weight_bytes
    head_w = shape.head_params or (shape.embedding_params if shape.tied_embeddings else 0)
    lora = st.lora
    if lora is not None and lora.quantized:
        linear = L * shape.block_linear_params
        weights = linear * NF4_BYTES + (shape.total_params - linear) * 4
    else:
        weights = shape.total_params * r
    trains = lora is None
    g_block = shape.block_params * r if trains else 0
    g_head = head_w * r if trains else 0
    g_rest = (shape.total_params * r - L * g_block - g_head) if trains else 0
    grads = shape.total_params * r if trains else 0
    states = _optimizer_states(shape, st) if trains else 0
    adapters = 0
    if lora is not None:
        adapters = lora_parameters(shape, lora) * ADAPTER_BYTES
    # FSDP gathering the blocks in the compute dtype (its mixed-precision policy): autocast finds them cast already
    gathered_cast = st.fsdp not in (None, "no_shard") and st.gather_bytes == st.compute_bytes
    copies_block = 2 * shape.block_linear_params if (st.cast and not (lora and lora.quantized) and not gathered_cast) \
        else 0
    copies_head = 2 * head_w if st.cast else 0
    shard = max(1, st.shard_group) if st.fsdp in ("full_shard", "hybrid_shard", "shard_grad_op") else 1
    w_shard = 1 if st.fsdp == "shard_grad_op" else shard  # kept whole between forward and backward
    if st.cpu_offload:
        weights = grads = states = g_block = g_head = g_rest = 0
    return {"weights": weights / w_shard, "grads": grads / shard, "states": states / shard,
            "g_block": g_block / shard, "g_head": g_head / shard, "g_rest": max(0, g_rest) / shard,
            "adapters": adapters / shard, "copies_block": copies_block, "copies_head": copies_head}


def _optimizer_states(shape: ModelShape, st: TrainingSetup) -> float:
    T, r = shape.total_params, st.weight_bytes
    if st.optimizer not in ("adamw_8bit", "paged_adamw_8bit"):
        return 2 * T * r
    full32 = shape.num_blocks * shape.block_small_params + shape.embedding_params + shape.other_params
    return full32 * 8 + (T - full32) * BNB_8BIT_BYTES


def _optimizer_temporaries(shape: ModelShape, st: TrainingSetup) -> float:
    """Scratch of one optimizer step: foreach AdamW keeps one full-size list; the single-tensor loop (CPU)
    two copies of the largest parameter; fused and 8-bit kernels update in place."""
    if st.lora is not None or st.optimizer != "adamw":
        return 0
    r = st.weight_bytes
    if st.device == "cuda":
        return shape.total_params * r
    largest = max([shape.embedding_params, shape.head_params] + [i * o for _, i, o in shape.block_linears])
    return 2 * largest * r


def _loss_bytes(shape: ModelShape, st: TrainingSetup) -> tuple[float, float, float]:
    """(forward peak, backward peak, saved through the backward) of logits and loss, in bytes."""
    N, V, h, c = st.tokens, shape.vocab_size, shape.hidden_size, st.compute_bytes
    if not st.chunked_loss:
        fwd = (c + (4 if c != 4 else 0) + 4) * N * V
        return fwd, 12 * N * V, 0
    C = min(st.chunk_tokens, N)
    hidden = (c if st.cast else st.residual_bytes) * h * N
    chunk = (4 + (c if c != 4 else 0)) * C * V  # a chunk's fp32 logits beside the 16-bit matmul output they upcast
    fwd = chunk  # the log-sum-exp runs in the fp32 logits' own storage
    bwd = chunk + hidden  # recomputed logits -> softmax - onehot in place, and its 16-bit copy; the hidden gradient
    saved = hidden + 12 * N  # hidden copy, log-sum-exp and targets
    return fwd, bwd, saved


# ------------------------------------------------------------------------------------------- estimate
def estimate(shape: ModelShape, st: TrainingSetup) -> MemoryEstimate:
    """The peak of one steady-state step of ``shape`` trained as ``st`` (see the module docstring)."""
    N, L, h = st.tokens, shape.num_blocks, shape.hidden_size
    r, c = st.residual_bytes, st.compute_bytes
    trains = st.lora is None
    p = _param_items(shape, st)
    # a tiled MLP keeps its input for its tiles and one tile's intermediates at a time (its recompute in backward)
    mlp = mlp_saved_per_token(shape, st) if st.mlp_tiles is not None else 0.0
    tile = min(N, st.micro_batch * st.mlp_tiles.tile_length(st.seq_len)) if mlp else N
    block = block_saved_per_token(shape, st) * N - mlp * (N - tile) + (r * h * N if mlp else 0)
    # a checkpointed block keeps its input, in host memory where offloaded (the next one prefetched in backward)
    kept = [(0 if st.offload_inputs else r * h * N) if k in set(st.checkpointed) else block for k in range(L)]
    prefetched = r * h * N if st.offload_inputs and st.checkpointed else 0
    final = norm_saved_per_token(shape, st) * N  # the last block's output is its fp32 input (the embedding output is
    if trains and not st.chunked_loss:  # block 0's input: its norm or its checkpoint keeps it)
        final += (c if st.cast else r) * h * N  # lm_head's input
    loss_fwd, loss_bwd, loss_saved = _loss_bytes(shape, st)
    acts_all = sum(kept) + final
    cache = (2 * r * shape.kv_width * N * L) if (st.use_cache and st.cast) else 0
    # backward: the residual's gradient and two MLP gradients; or, earlier, the recompute's adapter input in fp32
    temps_block = max(N * r * h + tile * 2 * c * shape.intermediate_size + _lora_grad_transient(shape, st, N, tile),
                      _lora_transient(shape, st, N, tile), N * r * h + _blocked_attention_backward(shape, st, c))
    if st.experts == "batched_mm" and shape.experts_per_token and shape.expert_intermediate_size:
        # the gathered gate/up weights' gradient (2.I.h per pair) once down_proj's gathered weights (I.h) are freed
        temps_block += N * shape.experts_per_token * _gathered_per_pair(shape, c) / 3
    gathered = 0
    if st.fsdp and st.fsdp != "no_shard":
        gathered = 2 * shape.block_params * (st.gather_bytes or st.weight_bytes)
    if st.lora is not None and st.lora.quantized:
        gathered += c * max((i * o for _, i, o in shape.block_linears), default=0)  # one dequantized weight
    carried = p["grads"] if st.grad_accum > 1 else 0
    # adapter gradients exist from their block's backward to zero_grad (set to None), or all along when accumulating
    a_grads = p["adapters"] * 4 / ADAPTER_BYTES if st.grad_accum == 1 else 0
    base = {"weights": p["weights"], "optimizer_states": p["states"], "lora_adapters": p["adapters"] - a_grads}
    # autocast casts each fp32 adapter weight once per forward (cached while autocast is on), kept for backward
    a_copies = (p["adapters"] * c / ADAPTER_BYTES) if (st.lora is not None and st.autocasts and c < 4) else 0
    copies_all = L * p["copies_block"] + p["copies_head"] + a_copies

    phases: dict[str, dict] = {}
    phases["forward (loss computed)"] = {**base, "autocast_weight_copies": copies_all, "gradients": carried,
                                         "activations": acts_all + cache, "logits_and_loss": loss_fwd + loss_saved,
                                         "temporaries": gathered}
    head_grad = p["g_head"] + p["g_rest"] if st.grad_accum == 1 else carried
    phases["backward (loss)"] = {**base, "autocast_weight_copies": copies_all,
                                 "gradients": carried if not st.chunked_loss else head_grad,
                                 "activations": acts_all, "logits_and_loss": loss_bwd + loss_saved,
                                 "temporaries": gathered}
    for k in range(L - 1, -1, -1):
        done = p["g_head"] + p["g_rest"] + (L - 1 - k) * p["g_block"]
        phases[f"backward (block {k})"] = {
            **base, "autocast_weight_copies": (k + 1) * (p["copies_block"] + a_copies / L),
            "lora_adapters": base["lora_adapters"] + a_grads * (L - k) / L,
            "gradients": carried if st.grad_accum > 1 else done,
            # a checkpointed block's own input, held by its checkpoint beside the norm's fp32 copy of a 16-bit one
            "activations": sum(kept[:k]) + block + prefetched + (loss_saved if st.chunked_loss else 0)
            + (r * h * N if k in set(st.checkpointed) and r != 4 else 0),
            "temporaries": temps_block + gathered}
    phases["optimizer step"] = {**base, "lora_adapters": p["adapters"], "gradients": p["grads"],
                                "temporaries": _optimizer_temporaries(shape, st)}

    overhead = CUDA_CONTEXT if st.device == "cuda" else 0
    totals = {name: int(sum(items.values())) for name, items in phases.items()}
    peak = max(totals, key=totals.get)
    breakdown = {item: int(round(phases[peak].get(item, 0))) for item in ITEMS if item != "overhead"}
    breakdown["overhead"] = overhead
    sizes = {"weights": int(p["weights"]), "autocast_weight_copies": int(copies_all), "gradients": int(p["grads"]),
             "optimizer_states": int(p["states"]), "lora_adapters": int(p["adapters"]),
             "activations": int(acts_all + cache), "logits_and_loss": int(max(loss_fwd, loss_bwd) + loss_saved),
             "temporaries": int(max(temps_block + gathered, _optimizer_temporaries(shape, st))),
             "overhead": overhead}
    return MemoryEstimate(total_bytes=sum(breakdown.values()), breakdown=breakdown, peak_phase=peak,
                          phases={k: v + overhead for k, v in totals.items()}, sizes=sizes, setup=st,
                          notes=setup_notes(shape, st, compiled_partition(shape, st)))
