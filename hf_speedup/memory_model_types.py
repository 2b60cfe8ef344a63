"""What :func:`hf_speedup.memory_model.estimate` takes and gives: the training set-up a step's memory depends on
(batch, dtypes, LoRA, optimizer, FSDP...), the estimate with its breakdown into items, and how bytes are printed.
Kept apart from the formulas (memory_model.py, whose docstring states them) so that file holds the arithmetic
only; callers import every name from :mod:`hf_speedup.memory_model`, as before."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

ITEMS = ("weights", "autocast_weight_copies", "gradients", "optimizer_states", "lora_adapters", "activations",
         "logits_and_loss", "temporaries", "overhead")
ITEM_TEXT = {
    "weights": "model weights on the device",
    "autocast_weight_copies": "bf16/fp16 copies (autocast)",
    "gradients": "weight gradients",
    "optimizer_states": "optimizer states",
    "lora_adapters": "adapters, their grads, states",
    "activations": "kept for backward",
    "logits_and_loss": "logits, log-softmax, grads",
    "temporaries": "backward/optimizer scratch",
    "overhead": "CUDA context",
}
OPTIMIZERS = ("adamw_fused", "adamw", "adamw_8bit", "paged_adamw_8bit", "other")


@dataclass(frozen=True)
class LoraShape:
    rank: int = 16
    targets: tuple[str, ...] | str = "all-linear"  # Linear leaf names, or peft's "all-linear"
    dropout: float = 0.0
    quantized: bool = False  # QLoRA: block Linear weights in 4-bit NF4
    expert_targets: tuple[str, ...] | str = ()  # fused expert weights with adapters (peft target_parameters), or "all"


@dataclass(frozen=True)
class MlpTiles:
    """The tiled MLP's rule (``features/tiled_mlp``'s ``TileRule``, as numbers): ``fixed_tiles`` at any length, else
    ``tile_tokens`` per tile, else ``n // min_tile_tokens`` tiles, at most ``max_tiles``."""

    tile_tokens: int | None = None
    min_tile_tokens: int = 1024
    max_tiles: int = 1
    fixed_tiles: int | None = None

    def tile_length(self, n: int) -> int:
        """The longest tile of a row of ``n`` tokens."""
        if self.fixed_tiles:
            tiles = self.fixed_tiles
        elif self.tile_tokens:
            tiles = -(-n // self.tile_tokens)
        else:
            tiles = max(1, min(self.max_tiles, n // max(1, self.min_tile_tokens)))
        return -(-n // max(1, tiles))

    @classmethod
    def of(cls, settings: Any) -> "MlpTiles | None":
        """From the tiled_mlp decision's settings (None where it is off): its ``rule``, else its ``tile_tokens``."""
        rule = getattr(settings, "rule", None)
        if rule is not None:
            return cls(getattr(rule, "tile_tokens", None), getattr(rule, "min_tile_tokens", 1024),
                       getattr(rule, "max_tiles", 1), getattr(rule, "fixed_tiles", None))
        n = getattr(settings, "tile_tokens", None)
        return cls(tile_tokens=n) if n else None


@dataclass(frozen=True)
class TrainingSetup:
    """What one step's memory depends on besides the model's sizes (a plan, a batch, a device)."""

    micro_batch: int
    seq_len: int
    grad_accum: int = 1
    weight_bytes: int = 4  # the weights' dtype (gradients and AdamW states have it too)
    compute_bytes: int = 4  # 2 under bf16/fp16 autocast or with 16-bit weights
    lora: LoraShape | None = None
    checkpointed: tuple[int, ...] = ()  # indices of checkpointed blocks
    optimizer: str = "adamw_fused"  # adamw_fused | adamw | adamw_8bit | paged_adamw_8bit | other
    chunked_loss: bool = False
    chunk_tokens: int = 1024
    attention: str = "sdpa"
    attention_form: str | None = None  # blocked's form as the door chose it ("bmm", a tile size); None: its default
    experts: str = "eager"  # config._experts_implementation of a mixture of experts: eager | grouped_mm | batched_mm
    padded: bool = False  # batches carry a padding mask (no packing)
    use_cache: bool = False  # a KV cache is built in training forwards
    device: str = "cpu"
    fsdp: str | None = None  # full_shard | shard_grad_op | hybrid_shard | no_shard
    shard_group: int = 1  # ranks the parameters are sharded over
    cpu_offload: bool = False
    gather_bytes: int = 0  # bytes per element of FSDP's gathered parameters (0: the weights' own)
    compiled: bool = False  # the decoder blocks run compiled (AOT autograd's partition) from the first step
    autocast: bool | None = None  # bf16/fp16 autocast runs (the plan's precision); None: read off the dtypes (cast)
    mlp_tiles: MlpTiles | None = None  # the dense MLPs run over tiles of the sequence, each recomputed (tiled_mlp)
    offload_inputs: bool = False  # checkpointed blocks' inputs in host memory between forward and backward (CUDA)

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len

    @property
    def residual_bytes(self) -> int:
        """The residual stream's dtype: the weights', but fp32 under QLoRA (peft's k-bit preparation)."""
        return 4 if (self.lora is not None and self.lora.quantized) else self.weight_bytes

    @property
    def cast(self) -> bool:
        """Autocast over wider weights: each Linear casts its input and weight to the compute dtype."""
        return self.compute_bytes < self.residual_bytes

    @property
    def autocasts(self) -> bool:
        """Matmuls run under bf16/fp16 autocast: as the plan says, else wherever the weights are wider than the compute
        dtype (a 16-bit base under autocast has ``cast`` False, but peft's fp32 adapters are still autocast)."""
        return self.cast if self.autocast is None else self.autocast

    def replace(self, **changes: Any) -> "TrainingSetup":
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class MemoryEstimate:
    """The peak of one training step: ``total_bytes`` = the items of ``breakdown`` (alive at the peak)."""

    total_bytes: int
    breakdown: dict[str, int]
    peak_phase: str
    phases: dict[str, int] = field(default_factory=dict)  # every phase's total
    sizes: dict[str, int] = field(default_factory=dict)  # each item's full size, whether alive at the peak or not
    setup: TrainingSetup | None = None
    notes: tuple[str, ...] = ()
    plan_changes: tuple[str, ...] = ()  # what memory.budget changed in the plan (estimate_memory)

    @property
    def overhead_bytes(self) -> int:
        return self.breakdown.get("overhead", 0)

    @property
    def peak_tensor_bytes(self) -> int:
        """Live tensors at the peak (what MemTracker / max_memory_allocated measure): total minus the overhead."""
        return self.total_bytes - self.overhead_bytes

    def fits(self, budget_bytes: int | float) -> bool:
        return self.total_bytes <= budget_bytes

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["peak_tensor_bytes"] = self.peak_tensor_bytes
        return out

    def rows(self) -> list[list[str]]:
        """[item, at peak, full size, what] per item (zero items left out)."""
        rows = []
        for item in ITEMS:
            at_peak, size = self.breakdown.get(item, 0), self.sizes.get(item, 0)
            if at_peak or size:
                rows.append([item, fmt_bytes(at_peak), fmt_bytes(size), ITEM_TEXT[item]])
        rows.append(["total", fmt_bytes(self.total_bytes), "", f"peak: {self.peak_phase}"])
        return rows


def fmt_bytes(n: float) -> str:
    """Binary units, the way memory tools print them (1 GiB = 1024^3 bytes)."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


EXPERTS_MODELLED = {"eager": "transformers' expert loop", "grouped_mm": "transformers' grouped_mm experts",
                    "batched_mm": "transformers' batched_mm experts (each pair's expert weights gathered)"}


def setup_notes(shape: Any, st: TrainingSetup, compiled: bool) -> tuple[str, ...]:
    """What an estimate of ``shape`` trained as ``st`` leaves out or assumes (``compiled``: blocks as AOT autograd's
    partition saves them)."""
    notes = ["compiled blocks: activations as AOT autograd's partition saves them" if compiled
             else "eager-mode activations: compiled blocks fuse ops and usually keep less"]
    if shape.block_experts:
        kernel = EXPERTS_MODELLED.get(st.experts)
        notes.append(f"mixture of experts: activations modelled on {kernel or EXPERTS_MODELLED['eager']}, "
                     f"{shape.experts_per_token} routed expert(s) per token; the router's own tensors are not counted")
        if kernel is None:
            notes.append(f"experts implementation {st.experts!r} not modelled: counted as the loop")
        notes.append("the experts' routing indices (int64, a few bytes per token and expert) are not counted")
    if st.optimizer == "paged_adamw_8bit" and st.device == "cuda":
        notes.append("paged 8-bit states live in CUDA unified memory: outside torch.cuda.max_memory_allocated, "
                     "paged to host under pressure")
    if st.use_cache and st.cast:
        notes.append("config.use_cache builds a KV cache in training forwards; set model.config.use_cache = False "
                     "to save it")
    if st.device == "cuda":
        notes.append("the caching allocator reserves more than it allocates (fragmentation, typically 5-15%)")
    elif st.device == "cpu":
        notes.append("process RSS adds the Python runtime and libraries (~1 GB) and malloc's cached pages")
    return tuple(notes)
