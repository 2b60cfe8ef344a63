"""The sections of a SpeedupConfig: one dataclass per feature (plus ``report``), with its defaults and, in a
comment beside each field, its allowed values. What a user may ask for, in one place; the checks are in
:mod:`.validate`, the whole request in :class:`hf_speedup.config.SpeedupConfig`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

AUTO = "auto"


@dataclass
class PrecisionSettings:
    """Compute dtype. ``auto`` picks bf16 where it is fast here: a GPU with native bf16, a CPU with matrix units
    (AMX), or a CPU where this model's matmuls, timed at its shapes at the door, ran at least 1.25x fp32."""

    dtype: str = AUTO  # auto | keep (the TrainingArguments' own) | bf16 | fp16 | fp32
    tf32: Any = AUTO  # auto | keep | true | false (CUDA matmul/cudnn TF32)
    strict: bool = False  # raise instead of falling back when ``dtype`` cannot run here


@dataclass
class CompileSettings:
    """Regional torch.compile of the repeated decoder block (not the whole model)."""

    enabled: Any = False  # auto | true | false
    backend: str = "inductor"
    mode: str | None = None  # None | default | reduce-overhead | max-autotune | max-autotune-no-cudagraphs
    dynamic: bool | None = None  # None lets dynamo decide; False pins static shapes
    fullgraph: bool = False
    regions: str = "blocks"  # blocks | blocks+head (also compiles final norm + lm_head + loss)
    when: str = "always"  # always | pays_back: the first steps run eager, compile only if the run earns it back
    # auto: the compiled graphs and kernels saved beside each checkpoint and loaded when a run resumes from it | none
    # (neither) | a folder: also loaded from and saved to there, for repeated runs (features/compile/cache.py)
    cache_dir: Any = AUTO


@dataclass
class OptimizerSettings:
    """AdamW variant; falls back 8-bit -> fused -> plain unless ``strict``."""

    name: str = AUTO  # auto | keep (TrainingArguments.optim) | adamw | adamw_fused | adamw_8bit | paged_adamw_8bit
    strict: bool = False


@dataclass
class CheckpointingSettings:
    """Non-reentrant activation checkpointing, optionally on every N-th block only."""

    enabled: Any = False  # auto | true | false
    every_n_blocks: int = 1
    # auto | true | false: the checkpointed blocks' inputs kept in pinned host memory between forward and backward,
    # copied on a side stream and prefetched a block ahead (CUDA; on a CPU device there is nothing to offload to)
    offload: Any = False


@dataclass
class TiledMlpSettings:
    """Each block's MLP run over tiles of the sequence, each recomputed in backward: its intermediates never exist
    for the whole sequence (long context)."""

    enabled: Any = False  # auto (off beside compiled blocks) | true | false
    tile_tokens: Any = AUTO  # auto (from the MLP width and the length) | an integer >= 1: tokens per tile


@dataclass
class SequenceParallelSettings:
    """How the plan meets a row split over GPUs (accelerate's parallelism_config cp_size / sp_size): it is asked for
    there, not here."""

    # auto: planned for (rows unpacked, a kernel the backend takes, what cannot run refused up front); false: left
    # to accelerate and the Trainer as they are (no adaptation, no check)
    enabled: Any = AUTO


@dataclass
class MemorySettings:
    """Allocator knobs: CUDA ones (no-ops on CPU, reported) and the CPU malloc one (CPU training only)."""

    empty_cache_steps: int | None = None
    expandable_segments: bool = False
    cpu_reuse_freed: bool = False  # glibc keeps freed blocks mapped: no page faults per step on CPU
    activation_offloading: Any = False  # auto | true | false: TRL's SFTConfig.activation_offloading (CUDA)
    # The plan fits the step into this: bytes, a size ('24GB', '80GiB'), a fraction of the device's memory
    # (0.9) or auto (all of it); null: no budget. See features/memory/budget.py.
    budget: Any = None
    seq_len: int | None = None  # the longest batch row, for the budget (else the arguments' max_length)
    track_live_tensors: bool = False  # report: one step's peak of live tensor bytes (torch's MemTracker)


@dataclass
class LoraSettings:
    """peft LoRA; ``quantization='4bit'`` makes it QLoRA (bitsandbytes, CUDA only)."""

    enabled: bool = False
    r: int = 16
    alpha: int = 32
    dropout: float = 0.05
    target_modules: Any = AUTO  # auto | all-linear | [names]
    quantization: str | None = None  # None | 4bit | 8bit
    strict: bool = False  # raise instead of QLoRA -> LoRA fallback


@dataclass
class FsdpSettings:
    """PyTorch FSDP sharding of the decoder blocks."""

    enabled: bool = False
    version: int = 2  # 1 | 2
    strategy: str = "full_shard"  # full_shard | shard_grad_op | hybrid_shard | no_shard
    cpu_offload: bool = False
    state_dict_type: str = "sharded"  # sharded | full
    cpu_ram_efficient_loading: bool = True


@dataclass
class DataSettings:
    """Input pipeline: stable shapes (fewer recompiles) and loader workers."""

    pad_to_multiple_of: int | None = None
    num_workers: int | None = None  # None keeps the user's TrainingArguments value
    pin_memory: bool | None = None
    prefetch_factor: int | None = None
    persistent_workers: bool | None = None
    drop_last: bool | None = None  # True: no odd-sized last batch (static-shape compile would recompile for it)
    padding_free: Any = False  # auto | true | false: a batch becomes one row of its sequences, no padding
    packing: bool | None = None  # TRL's SFTConfig.packing (several examples per row); None keeps the trainer's


@dataclass
class LossSettings:
    """Causal-LM loss: chunked cross-entropy never holds the full tokens x vocab logits (or their gradient)."""

    chunked: Any = AUTO  # auto (the memory budget decides) | true | false
    chunk_tokens: int = 1024  # tokens per chunk: one chunk's fp32 logits are chunk_tokens x vocab x 4 bytes
    # auto: where the model's loss is its own mean (classification heads, BERT's masked LM, T5/BART), the Trainer's
    # token-count scaling is turned off, so gradient accumulation and several processes give the true mean;
    # stock: the Trainer's rule as it is (its loss is then gradient_accumulation_steps x processes too large there)
    scaling: Any = AUTO


@dataclass
class ProfileSettings:
    """torch.profiler over a window of steps: a trace for TensorBoard/Perfetto, top operators in the report."""

    enabled: bool = False
    wait: int = 1  # steps not profiled first (the first step allocates, compiles)
    warmup: int = 1  # profiled but discarded (profiler start-up)
    active: int = 2  # steps recorded into the trace
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    memory_snapshot: bool = True  # CUDA only: allocator history of the window -> pickle for PyTorch's memory viewer
    top_operators: int = 15  # rows of the top-operators table in the report


# Signals a preemption handler may take (SIGKILL/SIGSTOP cannot be caught; SIGQUIT keeps its core dump).
INTERRUPT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGXCPU")


@dataclass
class InterruptSettings:
    """Preemption: on these signals finish the optimizer step, save a checkpoint of it, exit 128 + signal."""

    enabled: Any = AUTO  # auto | true | false
    signals: list = field(default_factory=lambda: ["SIGTERM", "SIGINT", "SIGUSR1"])


@dataclass
class CrashSafeSettings:
    """Checkpoints written in a staging folder and renamed into place when complete; resume skips incomplete ones."""

    enabled: bool = True  # false: in place, as the stock Trainer writes them (file systems without atomic rename)
    # auto: the tensors are copied to host memory and written by a background thread while training goes on (off
    # under DeepSpeed, whose engine writes its own checkpoint) | true | false: the Trainer waits for every file
    asynchronous: Any = AUTO


@dataclass
class DeepSpeedSettings:
    """How the plan meets a DeepSpeed config the run is given (the config itself is the user's, never edited)."""

    strict: bool = False  # raise where the preset and the DeepSpeed config disagree, instead of adapting the plan


@dataclass
class AttentionSettings:
    """The attention kernel (``config._attn_implementation``), chosen per device, dtype and packing."""

    implementation: str = AUTO  # auto | keep | sdpa | sdpa_varlen | blocked | eager | flash_attention_2 | flash_attention_3 | flex_attention
    strict: bool = False  # raise instead of falling back when the kernel asked for cannot run here


@dataclass
class ExpertsSettings:
    """How a mixture of experts runs its routed experts (``config._experts_implementation``), chosen by timing."""

    implementation: str = AUTO  # auto | keep | eager | batched_mm | grouped_mm
    strict: bool = False  # raise instead of falling back when the implementation asked for cannot run here


@dataclass
class LigerSettings:
    """Liger's Triton kernels (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy) via TrainingArguments.use_liger_kernel."""

    enabled: Any = False  # auto (CUDA + liger-kernel installed) | true | false


@dataclass
class ReportSettings:
    """Where the report goes (what it measures does not change): a JSON file, the ``report_to`` trackers, the
    console. ``baseline`` turns all three off, so the run leaves ``output_dir``, the logs and stdout as the stock
    Trainer does; the report stays in ``trainer.speedup_report``."""

    # auto: <output_dir>/speedup_report.json (and the counters a resume carries, inside each checkpoint);
    # a path: the JSON there (a directory: speedup_report.json inside it); null: no file at all
    path: Any = AUTO
    trackers: bool = True  # plan and metrics to the report_to trackers (W&B, TensorBoard, ...)
    console: bool = True  # plan and metrics tables printed by the main process


SECTIONS: dict[str, type] = {
    "precision": PrecisionSettings,
    "compile": CompileSettings,
    "optimizer": OptimizerSettings,
    "checkpointing": CheckpointingSettings,
    "tiled_mlp": TiledMlpSettings,
    "sequence_parallel": SequenceParallelSettings,
    "memory": MemorySettings,
    "lora": LoraSettings,
    "fsdp": FsdpSettings,
    "data": DataSettings,
    "attention": AttentionSettings,
    "experts": ExpertsSettings,
    "liger": LigerSettings,
    "loss": LossSettings,
    "profile": ProfileSettings,
    "interrupt": InterruptSettings,
    "report": ReportSettings,
    "crash_safe": CrashSafeSettings,
    "deepspeed": DeepSpeedSettings,
}
