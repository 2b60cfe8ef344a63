"""FSDP sharding of the decoder blocks — through accelerate on GPUs, by hf_speedup itself on CPU.

Two backends, one decision:

- ``accelerate`` (CUDA, XPU): the Trainer's own FSDP, turned on through TrainingArguments
  (``fsdp`` + ``fsdp_config`` with ``version: 2``, ``transformer_layer_cls_to_wrap`` = every block class the
  block finder found, ``reshard_after_forward``, ``cpu_offload``, ``state_dict_type``...; HSDP through
  ``parallelism_config``), plus what ``fsdp_config`` cannot carry, set on the plugin arguments (explicit
  ``cpu_offload``, the FSDP1 ``sharding_strategy``, fp32-reduce mixed precision; ``settings.plugin_overrides``).
  accelerate shards when ``train()`` starts; verify runs again then.
- ``launch_config``: the preset asks for no FSDP but an ``accelerate launch`` FSDP config does; accelerate
  shards anyway (on accelerators), so the decision says so and verify checks the live model.
- ``hf_speedup`` (CPU, gloo): accelerate enables FSDP only on accelerators, so the stock Trainer would
  silently train with DDP. hf_speedup shards with FSDP2 ``fully_shard`` itself (``shard``) and keeps
  the Trainer from wrapping the sharded model (``trainer_hooks.FsdpTrainerMixin``).

Strategies under FSDP2: ``full_shard`` = ``reshard_after_forward=True``; ``shard_grad_op`` = ``False``;
``hybrid_shard`` = a 2-D mesh (replicate across nodes, shard within one); ``no_shard`` = a mesh whose
shard dimension has size 1 (parameters replicated, gradients all-reduced: DDP semantics). Through
accelerate, ``no_shard`` needs FSDP1 (explicit fallback, reported).

Hand-offs to other features, in ``settings``: ``activation_checkpointing`` is True when FSDP itself
checkpoints the blocks (``fsdp_config``, accelerate backend) and the checkpointing feature must not;
``activation_checkpointing_by`` names who does it ("fsdp" | "checkpointing" | None) — done once;
``qlora_quant_storage`` is the storage dtype 4-bit weights need to be shardable.

World size 1: on CPU there is nothing to shard across (off, with the reason). On one GPU FSDP is legit
(it exercises NCCL and the sharded checkpoint path) when launched with ``torchrun``/``accelerate launch``.

The modules, in the order a run meets them: ``settings`` (the frozen Settings and their one translation
into accelerate's options), ``launcher`` (what the launch environment says), ``decision`` (``decide``),
``trainer_args`` (``training_args``), ``model_checks`` (``apply``), ``shard``, ``trainer_hooks``,
``checkpoint``, ``summary`` and ``verification`` (``verify``).
"""

from __future__ import annotations

from .decision import decide
from .model_checks import apply
from .settings import NAME, Mesh, MixedPrecision, Settings, Wrap
from .trainer_args import training_args
from .trainer_hooks import FsdpTrainerMixin as TRAINER_HOOKS  # the Trainer methods FSDP changes
from .verification import verify

APPLIES_TO = "model"  # on CPU hf_speedup shards the model itself; through accelerate the arguments carry it

__all__ = ["APPLIES_TO", "NAME", "TRAINER_HOOKS", "Mesh", "MixedPrecision", "Settings", "Wrap", "apply", "decide", "training_args", "verify"]
