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
    experts: str = "eager"  # config._experts_implementation of a mixture of experts: eager | grouped_mm | batched_mm
    padded: bool = False  # batches carry a padding mask (no packing)
    use_cache: bool = False  # a KV cache is built in training forwards
    device: str = "cpu"
    fsdp: str | None = None  # full_shard | shard_grad_op | hybrid_shard | no_shard
    shard_group: int = 1  # ranks the parameters are sharded over
    cpu_offload: bool = False
    gather_bytes: int = 0  # bytes per element of FSDP's gathered parameters (0: the weights' own)
    compiled: bool = False  # the decoder blocks run compiled (AOT autograd's partition) from the first step

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
