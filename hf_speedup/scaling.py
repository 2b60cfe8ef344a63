"""A scaling plan on paper: on N nodes x G GPUs, FSDP across every GPU against HSDP (sharded inside a node,
replicated across nodes): per-rank memory, the bytes each rank sends per step, a lower bound of the step time.

Memory is :func:`hf_speedup.estimate.estimate_described` (the memory model) with a shard group of N x G (FSDP) or
G (HSDP). Communication, for one optimizer step of one micro-batch per rank, every parameter in an FSDP unit:

- FSDP2 (``fully_shard``) all-gathers each unit's parameters for the forward and again for the backward
  (``reshard_after_forward``), in the mixed-precision policy's parameter dtype (bf16: 2 bytes; fp32 without
  autocast), and reduce-scatters the gradients of the trainable parameters in fp32 (hf_speedup's policy);
  HSDP then all-reduces each gradient shard (1/G of them) across the N replicas.
- Ring collectives (NCCL's, as nccl-tests' PERFORMANCE.md counts them): an all-gather or reduce-scatter of M bytes
  over n ranks sends (n-1)/n x M per rank, an all-reduce 2 (n-1)/n x M.
- Where the bytes go: a ring over ranks on k nodes (g adjacent ranks per node) leaves each node once per ring, and
  NCCL runs one ring per NIC, so each GPU's NIC carries 1/g of its rank's bytes and NVLink the other (g-1)/g; a
  group of one rank per node (HSDP's replicas) sends everything over the NIC. Each GPU has its own NIC (DGX-style
  H100 nodes: 8 x 400 Gb/s).
- Time: NVLink moves its bytes at its per-direction bandwidth, the NICs theirs, the GPU computes the step's FLOPs
  (the report's count: ``6 N + 12 L H S`` per token for a full fine-tune, ``4 N_frozen + 6 N_trainable + 12 L H S``
  with adapters, recomputation left out) at its peak. Lower bound of the step: the largest of the three (all
  overlapped); without any overlap it is their sum. Per-message latency is left out: that is why it is a bound.

Which strategy: one node — full sharding (HSDP is the same there). Several nodes — HSDP where its per-rank
memory fits: its all-gathers (two per unit and step, on the critical path of the forward and the backward) stay
on NVLink, and the one collective that crosses nodes, an all-reduce of 1/G of the gradients, overlaps the
backward and puts no more bytes on each NIC than FSDP's all-gathers and reduce-scatters do; FSDP across every GPU
where only it fits (its per-rank memory is G times smaller in weights, gradients and optimizer states); neither:
the plan says so.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .config import SpeedupConfigError
from .estimate import estimate_described
from .hardware import Capabilities
from .memory_model import ADAPTER_BYTES, MemoryEstimate, fmt_bytes
from .model_info import ModelInfo
from .peak_flops import peak_flops_for
from .presets import resolve
from .report.measure import flops_per_token

GBIT = 1e9 / 8  # bytes per second in one Gb/s
NVLINK_GBPS = 3600.0  # H100 SXM NVLink 4: 18 links x 25 GB/s per direction = 450 GB/s = 3600 Gb/s
NETWORK_GBPS = 400.0  # one 400 Gb/s NIC per GPU (InfiniBand NDR / RoCE), as on DGX H100 nodes
GRADIENT_BYTES = 4  # hf_speedup's FSDP mixed-precision policy reduces gradients in fp32


@dataclass(frozen=True)
class Links:
    """Per-GPU bandwidths, bytes per second: NVLink inside a node (one direction), the NIC between nodes."""

    intra_node: float = NVLINK_GBPS * GBIT
    inter_node: float = NETWORK_GBPS * GBIT


@dataclass(frozen=True)
class Collective:
    name: str
    ranks: int  # in the group
    nodes: int  # the group spans
    payload_bytes: float  # the whole tensor set gathered or reduced (M)
    sent_bytes: float  # by each rank: (n-1)/n M, all-reduce 2 (n-1)/n M
    nic_bytes: float  # of which each GPU's NIC carries
    nvlink_bytes: float  # of which NVLink carries


@dataclass(frozen=True)
class StrategyPlan:
    strategy: str  # full_shard | hybrid_shard
    mesh: tuple[int, ...]
    memory: MemoryEstimate  # one rank
    fits: bool
    collectives: tuple[Collective, ...]
    compute_s: float
    nvlink_s: float
    nic_s: float

    @property
    def sent_bytes(self) -> float:
        return sum(c.sent_bytes for c in self.collectives)

    @property
    def nic_bytes(self) -> float:
        return sum(c.nic_bytes for c in self.collectives)

    @property
    def nvlink_bytes(self) -> float:
        return sum(c.nvlink_bytes for c in self.collectives)

    @property
    def bound_s(self) -> float:
        """The step cannot be shorter: compute, NVLink and NICs all busy at once."""
        return max(self.compute_s, self.nvlink_s, self.nic_s)

    @property
    def serial_s(self) -> float:
        """Nothing overlapped."""
        return self.compute_s + self.nvlink_s + self.nic_s

    @property
    def limited_by(self) -> str:
        times = {"compute": self.compute_s, "NVLink": self.nvlink_s, "network": self.nic_s}
        return max(times, key=times.get)


@dataclass(frozen=True)
class ScalingPlan:
    model: str
    parameters: int
    trainable_parameters: int
    nodes: int
    gpus_per_node: int
    micro_batch: int
    seq_len: int
    links: Links
    peak_flops: float
    flops_per_token: float
    memory_bytes: float
    fsdp: StrategyPlan
    hsdp: StrategyPlan
    chosen: str | None  # full_shard | hybrid_shard | None (nothing fits)
    why: str

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def tokens_per_rank(self) -> int:
        return self.micro_batch * self.seq_len

    def tokens_per_second_per_gpu(self, plan: StrategyPlan) -> float:
        """The bound's throughput: at most this many tokens per second and GPU."""
        return self.tokens_per_rank / plan.bound_s

    def mfu_at(self, tokens_per_second_per_gpu: float) -> float:
        """MFU of a measured throughput, by this plan's FLOPs per token and peak."""
        return tokens_per_second_per_gpu * self.flops_per_token / self.peak_flops

    def to_dict(self) -> dict:
        def strategy(p: StrategyPlan) -> dict:
            return {"strategy": p.strategy, "mesh": list(p.mesh), "memory_bytes": p.memory.total_bytes,
                    "fits": p.fits, "collectives": [dataclasses.asdict(c) for c in p.collectives],
                    "sent_bytes": p.sent_bytes, "nic_bytes": p.nic_bytes, "nvlink_bytes": p.nvlink_bytes,
                    "compute_s": p.compute_s, "nvlink_s": p.nvlink_s, "nic_s": p.nic_s, "bound_s": p.bound_s,
                    "serial_s": p.serial_s, "limited_by": p.limited_by,
                    "tokens_per_second_per_gpu_bound": self.tokens_per_second_per_gpu(p)}

        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("fsdp", "hsdp")}
        out.update(world_size=self.world_size, fsdp=strategy(self.fsdp), hsdp=strategy(self.hsdp))
        return out


def ring_collective(name: str, payload: float, ranks: int, nodes: int, all_reduce: bool = False) -> Collective:
    """A ring collective of ``payload`` bytes over ``ranks`` ranks on ``nodes`` nodes (adjacent ranks per node)."""
    sent = (2 if all_reduce else 1) * (ranks - 1) / ranks * payload if ranks > 1 else 0.0
    per_node = ranks // nodes
    nic = sent / per_node if nodes > 1 else 0.0
    return Collective(name, ranks, nodes, payload, sent, nic, sent - nic)


def collectives(strategy: str, nodes: int, gpus_per_node: int, parameters: int, trainable: int,
                gather_bytes: int) -> tuple[Collective, ...]:
    """What each rank sends in one step under ``strategy`` (see the module docstring)."""
    world = nodes * gpus_per_node
    params, grads = parameters * gather_bytes, trainable * GRADIENT_BYTES
    if strategy == "full_shard":
        return (ring_collective("all-gather (forward)", params, world, nodes),
                ring_collective("all-gather (backward)", params, world, nodes),
                ring_collective("reduce-scatter", grads, world, nodes))
    out = (ring_collective("all-gather (forward)", params, gpus_per_node, 1),
           ring_collective("all-gather (backward)", params, gpus_per_node, 1),
           ring_collective("reduce-scatter", grads, gpus_per_node, 1))
    if nodes > 1:
        out += (ring_collective("all-reduce (replicas)", grads / gpus_per_node, nodes, nodes, all_reduce=True),)
    return out


def gpu_caps(device_name: str, world_size: int, memory_bytes: float | None) -> Capabilities:
    """The Capabilities of a CUDA GPU this machine need not have (the plan is made as it would be there)."""
    return Capabilities(device_type="cuda", device_name=device_name, device_count=1, compute_capability=(9, 0),
                        bf16=True, fp16=True, tf32=True, fused_adamw=True, bitsandbytes=True, compile=True,
                        world_size=world_size, memory_bytes=int(memory_bytes) if memory_bytes else None)


def plan_scaling(described: tuple[ModelInfo, bool], speedup: Any, *, nodes: int, gpus_per_node: int,
                 batch_size: int, seq_len: int, device_name: str = "NVIDIA H100 80GB HBM3",
                 memory_bytes: float = 80e9, links: Links = Links(), peak_flops: float | None = None,
                 padded: bool = False) -> ScalingPlan:
    """FSDP against HSDP for ``speedup`` (its fsdp section's other settings kept) on that cluster."""
    problems = [f"{name} = {value!r} is not allowed; allowed: an integer >= 1; fix: e.g. {name}={example}"
                for name, value, example in (("nodes", nodes, 2), ("gpus_per_node", gpus_per_node, 8))
                if not isinstance(value, int) or isinstance(value, bool) or value < 1]
    if links.intra_node <= 0 or links.inter_node <= 0:
        problems.append(f"bandwidths = {links} are not allowed; allowed: positive bytes per second; fix: e.g. "
                        "--inter-node-gbps 400")
    if problems:
        raise SpeedupConfigError(problems)
    info, _ = described
    cfg = resolve(speedup)
    world = nodes * gpus_per_node
    caps = gpu_caps(device_name, world, memory_bytes)
    estimates = {}
    for strategy in ("full_shard", "hybrid_shard"):
        variant = cfg.replace(fsdp={"enabled": True, "strategy": strategy})
        estimates[strategy] = estimate_described(described, variant, batch_size=batch_size, seq_len=seq_len,
                                                 world_size=world, caps=caps, padded=padded,
                                                 gpus_per_node=gpus_per_node)
    setup = estimates["full_shard"].setup
    dtype = "bf16" if setup.compute_bytes == 2 else "fp32"
    peak = peak_flops if peak_flops is not None else peak_flops_for(device_name, dtype)
    if not peak:
        raise SpeedupConfigError([f"peak FLOP/s of {device_name!r} in {dtype} is not in hf_speedup's table; "
                                  "allowed: a GPU the table names (H100, H200, A100, ...) or an explicit peak; fix: "
                                  "--peak-flops 989e12"])
    trainable, frozen = _matmul_split(info, estimates["full_shard"])
    per_token = flops_per_token(trainable, frozen, info.num_layers or info.num_blocks,
                                info.shape.attention_width if info.shape else info.hidden_size, seq_len)
    compute_s = per_token * batch_size * seq_len / peak
    gather = setup.gather_bytes or setup.weight_bytes
    adapters = trainable if setup.lora is not None else 0
    with_grads = info.total_parameters if setup.lora is None else adapters  # a full fine-tune reduces every gradient
    plans = {}
    for strategy, est in estimates.items():
        comms = collectives(strategy, nodes, gpus_per_node, info.total_parameters + adapters, with_grads, gather)
        plans[strategy] = StrategyPlan(
            strategy=strategy, mesh=(world,) if strategy == "full_shard" else (nodes, gpus_per_node), memory=est,
            fits=est.total_bytes <= memory_bytes, collectives=comms, compute_s=compute_s,
            nvlink_s=sum(c.nvlink_bytes for c in comms) / links.intra_node,
            nic_s=sum(c.nic_bytes for c in comms) / links.inter_node)
    chosen, why = _choose(plans["full_shard"], plans["hybrid_shard"], nodes, gpus_per_node, memory_bytes)
    return ScalingPlan(model=info.architecture, parameters=info.total_parameters,
                       trainable_parameters=with_grads,
                       nodes=nodes, gpus_per_node=gpus_per_node, micro_batch=batch_size, seq_len=seq_len,
                       links=links, peak_flops=peak, flops_per_token=per_token, memory_bytes=memory_bytes,
                       fsdp=plans["full_shard"], hsdp=plans["hybrid_shard"], chosen=chosen, why=why)


def _matmul_split(info: ModelInfo, est: MemoryEstimate) -> tuple[int, int]:
    """(trainable, frozen) matmul parameters as the FLOPs count needs them: a full fine-tune trains every
    non-embedding weight; with adapters the base is frozen and the adapters train (the estimate sizes them)."""
    matmul = info.total_parameters - info.embedding_parameters
    if est.setup.lora is None:
        return matmul, 0
    shard = est.setup.shard_group if est.setup.fsdp else 1
    return round(est.sizes["lora_adapters"] * shard / ADAPTER_BYTES), matmul


def _choose(fsdp: StrategyPlan, hsdp: StrategyPlan, nodes: int, gpus: int, memory: float) -> tuple[str | None, str]:
    cap = fmt_bytes(memory)
    if nodes == 1:
        if fsdp.fits:
            return "full_shard", f"one node: HSDP is FSDP here; {fmt_bytes(fsdp.memory.total_bytes)}/rank fits {cap}"
        return None, (f"nothing fits: {fmt_bytes(fsdp.memory.total_bytes)}/rank sharded over all {gpus} GPUs of the "
                      f"node, {cap} per GPU; more nodes, activation checkpointing, a smaller micro-batch or LoRA")
    if hsdp.fits:
        return "hybrid_shard", (
            f"HSDP fits ({fmt_bytes(hsdp.memory.total_bytes)}/rank of {cap}): its all-gathers stay on NVLink, the only "
            f"traffic between nodes is the gradient all-reduce ({fmt_bytes(hsdp.nic_bytes)} per GPU's NIC against "
            f"FSDP's {fmt_bytes(fsdp.nic_bytes)}), which overlaps the backward; step >= {hsdp.bound_s:.3f} s, "
            f"limited by {hsdp.limited_by}")
    if fsdp.fits:
        return "full_shard", (
            f"HSDP does not fit ({fmt_bytes(hsdp.memory.total_bytes)}/rank: states sharded over one node's {gpus} GPUs "
            f"only), FSDP over all {nodes * gpus} does ({fmt_bytes(fsdp.memory.total_bytes)}/rank of {cap}); its "
            f"all-gathers cross nodes: {fmt_bytes(fsdp.nic_bytes)} per GPU's NIC per step; step >= "
            f"{fsdp.bound_s:.3f} s, limited by {fsdp.limited_by}")
    return None, (f"nothing fits: FSDP over all {nodes * gpus} GPUs needs {fmt_bytes(fsdp.memory.total_bytes)}/rank, "
                  f"{cap} per GPU; more nodes, activation checkpointing, a smaller micro-batch or LoRA")


# ------------------------------------------------------------------------------------------ text
def fmt_rate(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e9:.0f} GB/s ({bytes_per_s / GBIT:.0f} Gb/s)"


def table(plan: ScalingPlan) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): one row per quantity, one column per strategy."""
    cols = (plan.fsdp, plan.hsdp)
    headers = ["per rank, one step"] + [
        f"{'FSDP' if p.strategy == 'full_shard' else 'HSDP'} {' x '.join(map(str, p.mesh))}"
        + (" (chosen)" if p.strategy == plan.chosen else "") for p in cols]

    def sent(p: StrategyPlan, *names: str) -> float:
        return sum(c.sent_bytes for c in p.collectives if c.name in names)

    rows = [
        ["memory (estimate)"] + [fmt_bytes(p.memory.total_bytes) for p in cols],
        [f"fits {fmt_bytes(plan.memory_bytes)}"] + ["yes" if p.fits else "NO" for p in cols],
        ["all-gather sent"] + [fmt_bytes(sent(p, "all-gather (forward)", "all-gather (backward)")) for p in cols],
        ["reduce-scatter sent"] + [fmt_bytes(sent(p, "reduce-scatter")) for p in cols],
        ["all-reduce sent"] + [fmt_bytes(sent(p, "all-reduce (replicas)")) for p in cols],
        ["over NVLink"] + [fmt_bytes(p.nvlink_bytes) for p in cols],
        ["over the NIC"] + [fmt_bytes(p.nic_bytes) for p in cols],
        ["compute / NVLink / NIC"] + [f"{p.compute_s:.3f} / {p.nvlink_s:.3f} / {p.nic_s:.3f} s" for p in cols],
        ["step at least"] + [f"{p.bound_s:.3f} s ({p.limited_by})" for p in cols],
        ["tokens/s/GPU at most"] + [f"{plan.tokens_per_second_per_gpu(p):,.0f}" for p in cols],
    ]
    return headers, rows
