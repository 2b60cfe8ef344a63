"""The scaling plan (``hf-speedup estimate --nodes``): its figures against a hand computation for Llama-3-8B on
16 nodes x 8 H100 (a config built on the meta device, no hub), the strategy it picks, the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_speedup.config import SpeedupConfigError
from hf_speedup.estimate import describe_for_estimate
from hf_speedup.scaling import Links, plan_scaling, ring_collective

ROOT = Path(__file__).resolve().parents[1]
LLAMA3_8B = ROOT / "benchmarks" / "scaling" / "llama-3-8b.json"
LLAMA3_70B = ROOT / "benchmarks" / "scaling" / "llama-3-70b.json"
LEAN = ROOT / "benchmarks" / "scaling" / "fsdp-lean.yaml"

P = 8_030_261_248  # Llama-3-8B parameters
EMBED = 128_256 * 4_096  # the input embedding (a lookup: no FLOPs); the untied lm_head is a matmul
H100_BF16 = 989e12
NVLINK, NIC = 450e9, 50e9  # bytes/s per GPU: NVLink 4 one direction, a 400 Gb/s NIC


@pytest.fixture(scope="module")
def llama3_8b():
    return describe_for_estimate(str(LLAMA3_8B))


@pytest.fixture(scope="module")
def plan_16x8(llama3_8b):
    return plan_scaling(llama3_8b, str(LEAN), nodes=16, gpus_per_node=8, batch_size=2, seq_len=8192,
                        memory_bytes=85e9)


def test_the_8b_model_is_the_one_meta_published(llama3_8b):
    info = llama3_8b[0]
    assert (info.total_parameters, info.embedding_parameters, info.num_layers) == (P, EMBED, 32)


def test_flops_and_compute_time_by_hand(plan_16x8):
    per_token = 6 * (P - EMBED) + 12 * 32 * 4096 * 8192  # 6N + 12 L H S, N without the embedding lookup
    assert plan_16x8.flops_per_token == per_token == 57_914_449_920
    assert plan_16x8.peak_flops == H100_BF16  # the table's H100 SXM bf16 dense peak
    compute = per_token * 2 * 8192 / H100_BF16
    assert plan_16x8.fsdp.compute_s == pytest.approx(compute) and compute == pytest.approx(0.9594, abs=1e-4)


def test_fsdp_bytes_by_hand(plan_16x8):
    """FSDP over 128 ranks: bf16 all-gathers forward and backward, fp32 reduce-scatter, every ring over 16 nodes:
    1/8 of each rank's bytes leave the node through its NIC."""
    f = plan_16x8.fsdp
    sent = {c.name: c.sent_bytes for c in f.collectives}
    assert sent == pytest.approx({"all-gather (forward)": 127 / 128 * 2 * P, "all-gather (backward)": 127 / 128 * 2 * P,
                                  "reduce-scatter": 127 / 128 * 4 * P})
    assert f.nic_bytes == pytest.approx(127 / 128 * 8 * P / 8)
    assert f.nvlink_bytes == pytest.approx(127 / 128 * 8 * P * 7 / 8)
    assert (f.nic_s, f.nvlink_s) == pytest.approx((127 / 128 * P / NIC, 127 / 128 * 7 * P / NVLINK))
    assert f.nic_s == pytest.approx(0.1594, abs=1e-4)


def test_hsdp_bytes_by_hand(plan_16x8):
    """HSDP 16 x 8: the gathers and the reduce-scatter inside a node (NVLink only), then an all-reduce of the 1/8
    gradient shard across the 16 replicas, one rank per node: all of it over the NIC."""
    h = plan_16x8.hsdp
    sent = {c.name: c.sent_bytes for c in h.collectives}
    assert sent == pytest.approx({"all-gather (forward)": 7 / 8 * 2 * P, "all-gather (backward)": 7 / 8 * 2 * P,
                                  "reduce-scatter": 7 / 8 * 4 * P, "all-reduce (replicas)": 2 * 15 / 16 * 4 * P / 8})
    assert h.nic_bytes == pytest.approx(2 * 15 / 16 * 4 * P / 8) and h.nic_bytes < plan_16x8.fsdp.nic_bytes
    assert h.nvlink_bytes == pytest.approx(7 / 8 * 8 * P)
    assert h.bound_s == pytest.approx(h.compute_s) and h.limited_by == "compute"  # 0.959 s > 0.125 / 0.151 s
    assert plan_16x8.tokens_per_second_per_gpu(h) == pytest.approx(2 * 8192 / h.compute_s)


def test_memory_per_rank_is_the_estimate_sharded_16_times_more_under_fsdp(plan_16x8):
    f, h = plan_16x8.fsdp.memory, plan_16x8.hsdp.memory
    for item, per_param in (("weights", 4), ("gradients", 4), ("optimizer_states", 8)):  # fp32, AdamW
        assert f.sizes[item] == pytest.approx(per_param * P / 128, rel=1e-6), item
        assert h.sizes[item] == pytest.approx(per_param * P / 8, rel=1e-6), item
    assert f.sizes["autocast_weight_copies"] == h.sizes["autocast_weight_copies"] == 2 * 128_256 * 4_096  # head
    assert plan_16x8.fsdp.fits and plan_16x8.hsdp.fits


def test_the_plan_picks_hsdp_where_it_fits_and_fsdp_where_only_fsdp_does(plan_16x8):
    assert plan_16x8.chosen == "hybrid_shard"
    assert plan_16x8.why.startswith("HSDP fits (24.27 GiB/rank of 79.16 GiB): its all-gathers stay on NVLink")
    seventy = plan_scaling(describe_for_estimate(str(LLAMA3_70B)), str(LEAN), nodes=8, gpus_per_node=8,
                           batch_size=2, seq_len=8192, memory_bytes=85e9)
    assert seventy.chosen == "full_shard" and not seventy.hsdp.fits and seventy.fsdp.fits
    sizes = seventy.hsdp.memory.sizes
    assert sizes["weights"] + sizes["gradients"] + sizes["optimizer_states"] > 85e9  # 16 bytes/parameter over 8 GPUs
    assert seventy.why.startswith("HSDP does not fit")
    one = plan_scaling(describe_for_estimate(str(LLAMA3_70B)), str(LEAN), nodes=1, gpus_per_node=8, batch_size=2,
                       seq_len=8192, memory_bytes=85e9)
    assert one.chosen is None and one.why.startswith("nothing fits")


def test_a_ring_inside_one_node_never_touches_the_nic():
    inside = ring_collective("all-gather", 8e9, ranks=8, nodes=1)
    assert (inside.sent_bytes, inside.nic_bytes, inside.nvlink_bytes) == (7e9, 0.0, 7e9)
    across = ring_collective("all-reduce", 8e9, ranks=4, nodes=4, all_reduce=True)  # one rank per node
    assert (across.sent_bytes, across.nic_bytes, across.nvlink_bytes) == (12e9, 12e9, 0.0)


def test_bad_cluster_shapes_are_one_clear_error(llama3_8b):
    with pytest.raises(SpeedupConfigError, match=r"(?s)2 problem\(s\).*nodes = 0 is not allowed.*gpus_per_node = -1"):
        plan_scaling(llama3_8b, "fsdp", nodes=0, gpus_per_node=-1, batch_size=1, seq_len=128)
    with pytest.raises(SpeedupConfigError, match=r"bandwidths = .* are not allowed"):
        plan_scaling(llama3_8b, "fsdp", nodes=2, gpus_per_node=8, batch_size=1, seq_len=128, links=Links(inter_node=0))


def test_cli_prints_the_plan_and_exits_1_when_nothing_fits(capsys):
    from hf_speedup.cli import main

    args = ["estimate", "--config", str(LLAMA3_8B), "--preset", str(LEAN), "--batch-size", "2", "--seq-len", "8192",
            "--nodes", "16", "--gpus-per-node", "8"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "16 node(s) x 8 NVIDIA H100 80GB HBM3 (128 ranks)" in out
    assert "50 GB/s (400 Gb/s) between nodes (NIC); peak 989 TFLOP/s; 57.9 GFLOP per token" in out
    assert "HSDP 16 x 8 (chosen)" in out and "plan: HSDP: HSDP fits" in out
    assert main(args + ["--inter-node-gbps", "100", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fsdp"]["nic_s"] == pytest.approx(127 / 128 * P / 12.5e9)  # a quarter of the bandwidth
    assert main(["estimate", "--config", str(LLAMA3_70B), "--preset", str(LEAN), "--batch-size", "2", "--seq-len",
                 "8192", "--nodes", "1"]) == 1
    assert "plan: neither: nothing fits" in capsys.readouterr().out
