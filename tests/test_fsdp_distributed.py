"""A real sharded run: ``torchrun --nproc_per_node 2`` on CPU (gloo) with the ``fsdp`` presets.

One torchrun launch runs every phase of tests/dist/fsdp_train.py (about a minute on 2 cores); the
assertions below read what each rank saw on its live objects. The single-process reference runs in
this process (same data, same global batch of 8). A second launch goes through ``accelerate launch``
with the shipped FSDP2 YAML, exactly as the docs show it (plus ``--num_processes 2``, CPU).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from distributed_helpers import DIST, distributed_marks, executable, launch, rank_results
from fake_cpu import FAKE_CPU_AMX

import fsdp_train as F  # tests/dist: importable once distributed_helpers is

pytestmark = distributed_marks()
SCRIPT = DIST / "fsdp_train.py"

FULL_BYTES = 213_568 * 4  # the tiny Llama (hidden 64, 4 blocks, vocab 512) in fp32


# The torchrun run and its reference plan for a CPU without AMX whatever the machine (fp32: the tight check of
# the sharded math); the bf16 path is its "strategies" phase (forced bf16) and the accelerate launch below,
# run for both CPU kinds.
NO_AMX = {FAKE_CPU_AMX: "0"}


def _launch(cmd: list[str], out: Path, env: dict | None = None) -> list[dict]:
    launch(cmd, env=env)
    return rank_results(out)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp2")
    ranks = _launch([executable("torchrun"), "--standalone", "--nproc_per_node", "2", str(SCRIPT), "--out", str(out)],
                    out, NO_AMX)
    return out, ranks


def _reference(out: Path, env: dict) -> tuple[dict[int, float], dict]:
    """The single-process reference, planned in the environment of the launch it is compared with."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        losses, decision, dtype = F.reference_losses(out)
    assert decision["applied"] == "off"  # one process: FSDP off (the reason says why), same preset otherwise
    return losses, dtype


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _reference(tmp_path_factory.mktemp("reference"), NO_AMX)[0]


def _tolerance(rank0: dict) -> float:
    mp = rank0["main"]["decision"]["settings"].get("mixed_precision")
    return 1e-4 if not mp else 3e-2  # fp32: reduction order only; bf16: rounding


# ------------------------------------------------------------------------------------------ sharding
def test_parameters_are_dtensors_sharded_across_the_two_ranks(run):
    _, ranks = run
    for r, res in enumerate(ranks):
        m = res["main"]
        assert res["world_size"] == 2
        assert m["all_dtensor"], "every parameter must be a DTensor"
        assert m["model_class"] == "FSDPLlamaForCausalLM"
        assert m["wrapped_class"] == "FSDPLlamaForCausalLM"  # not DistributedDataParallel
        assert m["embed_placements"] == "(Shard(dim=0),)"
        assert (m["embed_global_shape"], m["embed_local_shape"]) == ([512, 64], [256, 64])
        s = m["summary"]
        assert s["units"] == 7  # 4 LlamaDecoderLayer + embeddings + norm/lm_head + root
        assert s["unit_names"] == [f"model.layers.{i}" for i in range(4)] + ["model.embed_tokens", "model.norm+lm_head",
                                                                            "<root>"]
        assert s["total_bytes"] == FULL_BYTES
        assert s["this_rank_bytes"] == FULL_BYTES // 2  # each rank holds half
        assert s["rank_bytes"] == {"0": FULL_BYTES // 2, "1": FULL_BYTES // 2}
        assert s["plain_parameters"] == 0 and s["sharded"] is True


def test_loss_matches_a_single_process_run_of_the_same_data(run, reference):
    """Rank r initialises its model with seed r: matching the reference also proves rank 0's weights were broadcast."""
    _, ranks = run
    tol = _tolerance(ranks[0])
    for res in ranks:
        got = {int(k): v for k, v in res["main"]["losses"].items()}
        assert sorted(got) == list(range(1, F.STEPS + 1))
        diffs = {s: abs(got[s] - reference[s]) for s in got}
        assert max(diffs.values()) < tol, diffs
    assert reference[F.STEPS] < reference[1] - 0.3  # and it learns


def test_sharded_checkpoint_saves_and_training_resumes_from_it(run):
    out, ranks = run
    main = ranks[0]["main"]
    assert {"pytorch_model_fsdp_0", "optimizer_0", "scheduler.pt", "trainer_state.json", "rng_state_0.pth",
            "rng_state_1.pth", "config.json"} <= set(main["checkpoint_files"])
    assert "model.safetensors" not in main["checkpoint_files"]  # sharded: no rank gathers the full model
    assert main["model_shard_files"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]  # one shard per rank
    # resumed from checkpoint-4 into a model initialised with another seed: steps 5-8 are the same run
    for res in ranks:
        assert res["resume"]["engaged"] is True
        orig = res["main"]["losses"]
        resumed = res["resume"]["losses"]
        for step in range(F.SAVE_AT + 1, F.STEPS + 1):
            assert abs(resumed[str(step)] - orig[str(step)]) < 1e-5, (step, resumed, orig)


def test_report_says_fsdp_engaged_with_units_and_per_rank_bytes(run):
    out, ranks = run
    report = json.loads((out / "main" / "speedup_report.json").read_text())
    entry = report["plan"]["fsdp"]
    assert entry["engaged"] is True and entry["applied"] == "fsdp2"
    assert "FSDP2 full_shard: 7 units, 2 ranks, 427.1 KB/rank of 854.3 KB" in entry["reason"]
    verified = entry["settings"]["verified"]
    assert verified["units"] == 7 and verified["world_size"] == 2
    assert verified["rank_bytes"] == {"0": FULL_BYTES // 2, "1": FULL_BYTES // 2}
    assert entry["settings"]["backend"] == "hf_speedup"
    assert ranks[0]["main_init"]["engaged"] is True  # sharded already when SpeedupTrainer returns


def test_final_save_model_is_a_full_loadable_model(run):
    """The saved fp32 model reproduces the sharded model's loss; the sharded one computes in the plan's dtype
    (bf16 mixed precision on an AMX CPU), so the tolerance is that dtype's rounding."""
    _, ranks = run
    m = ranks[0]["main"]
    assert m["saved_parameters"] == FULL_BYTES // 4
    rel = {"fp32": 2e-6, "bf16": 4e-3}[m["compute_dtype"]]  # 4e-3: bf16's 8-bit mantissa, 2**-8
    assert m["final_loss_saved"] == pytest.approx(m["final_loss_sharded"], rel=rel)


# ------------------------------------------------------------------------------------------ variants
def test_lora_adapters_train_under_fsdp2(run):
    _, ranks = run
    lo = ranks[0]["lora"]
    assert lo["lora"]["applied"] == "lora" and lo["lora"]["engaged"] is True
    assert lo["decision"]["engaged"] is True and lo["decision"]["settings"]["lora"] is True
    assert lo["model_class"] == "FSDPPeftModelForCausalLM"
    assert lo["all_dtensor"] and lo["trainable_dtensor"]  # adapters sharded with their blocks
    assert lo["summary"]["units"] == 7 and lo["summary"]["sharded"]
    assert lo["lora_tensors"] > 0 and lo["changed_lora"] == lo["lora_tensors"]  # every adapter moved
    assert lo["changed_base"] == []  # the frozen base did not
    assert "adapter_model.safetensors" in lo["saved_files"]
    assert all(math.isfinite(v) for v in lo["losses"].values())


def test_lora_on_a_mixture_of_experts_trains_the_expert_adapters_under_fsdp2(run):
    """peft's ParamWrapper (adapters on the fused 3-D expert weights) shards with its block and trains."""
    _, ranks = run
    for res in ranks:
        moe = res["moe_lora"]
        assert moe["lora"]["engaged"] is True and moe["decision"]["engaged"] is True
        assert moe["all_dtensor"] and moe["trainable_dtensor"]
        assert moe["adapters"]["model.layers.*.mlp.experts.gate_up_proj"] == 2
        assert moe["adapters"]["model.layers.*.mlp.experts.down_proj"] == 2
        assert all(math.isfinite(v) for v in moe["losses"].values()) and len(moe["losses"]) == 3
    moe = ranks[0]["moe_lora"]
    assert len(moe["changed_expert_lora"]) == 8  # lora_A and lora_B of both expert weights in both blocks
    assert moe["changed_base"] == []  # the experts themselves and the router stay frozen


def test_fsdp_offload_preset_runs_on_cpu(run):
    _, ranks = run
    off = ranks[0]["offload"]
    assert off["decision"]["engaged"] is True and off["decision"]["settings"]["cpu_offload"] is True
    assert "parameters already live in host memory" in off["decision"]["reason"]
    assert off["checkpointing"]["engaged"] is True  # done once: by the checkpointing feature, before sharding
    assert off["summary"]["sharded"] and len(off["losses"]) == 3


def test_full_state_dict_checkpoint_resumes(run):
    _, ranks = run
    full = ranks[0]["full"]
    assert {"pytorch_model_fsdp.bin", "optimizer.bin", "model.safetensors"} <= set(full["checkpoint_files"])
    assert "pytorch_model_fsdp_0" not in full["checkpoint_files"] and "optimizer_0" not in full["checkpoint_files"]
    for step in (3, 4):
        assert abs(full["resume_losses"][str(step)] - full["losses"][str(step)]) < 1e-5


@pytest.mark.parametrize("strategy, placements, local_rows, per_rank", [
    ("shard_grad_op", "(Shard(dim=0),)", 256, FULL_BYTES // 2),
    ("hybrid_shard", "(Replicate(), Shard(dim=0))", 256, FULL_BYTES // 2),  # one node: replicas of 1, shard over 2
    ("no_shard", "(Replicate(), Shard(dim=0))", 512, FULL_BYTES),  # shard dim of size 1: replicated on purpose
])
def test_strategies(run, strategy, placements, local_rows, per_rank):
    _, ranks = run
    st = ranks[1]["strategies"][strategy]
    assert st["decision"]["engaged"] is True
    assert st["embed_placements"] == placements and st["embed_local_shape"][0] == local_rows
    assert st["summary"]["this_rank_bytes"] == per_rank
    assert st["decision"]["settings"]["reshard_after_forward"] is (strategy != "shard_grad_op")


def test_tied_embeddings_stay_tied_in_one_unit(run):
    _, ranks = run
    tied = ranks[0]["strategies"]["tied"]
    assert tied["still_tied"] and tied["decision"]["engaged"] is True
    assert tied["summary"]["unit_names"] == [f"model.layers.{i}" for i in range(4)] + ["<root>"]
    assert tied["summary"]["total_bytes"] == FULL_BYTES - 512 * 64 * 4  # the shared weight counted once


def test_gradient_accumulation_gives_the_same_steps(run):
    _, ranks = run
    ga, main = ranks[0]["strategies"]["ga"], ranks[0]["main"]
    assert ga["decision"]["engaged"] is True
    assert math.isfinite(ga["eval_loss"]) and ga["eval_loss"] < ga["losses"]["1"]  # evaluate() works sharded too
    for step in ("1", "2"):  # step 3 differs by design: max_steps=3 changes the linear LR schedule
        assert abs(ga["losses"][step] - main["losses"][step]) < 1e-4


def test_bf16_uses_an_fsdp2_mixed_precision_policy(run):
    _, ranks = run
    bf = ranks[0]["strategies"]["bf16"]
    assert bf["decision"]["settings"]["mixed_precision"] == {"param_dtype": "bf16", "reduce_dtype": "fp32"}
    assert bf["decision"]["engaged"] is True and bf["precision"]["engaged"] is True  # autocast in force too
    assert bf["summary"]["sharded"]
    assert abs(bf["losses"]["1"] - ranks[0]["main"]["losses"]["1"]) < 3e-2


def test_the_stock_trainer_trap_and_a_stale_optimizer(run):
    _, ranks = run
    trap = ranks[0]["trap"]
    # measured: accelerate enables FSDP only on accelerators -> the stock Trainer trains with DDP on CPU
    assert trap["stock_wrapped"] == "DistributedDataParallel" and trap["stock_fsdp_enabled"] is False
    assert trap["auto_fsdp"]["engaged"] is False and "does NOT shard on CPU" in trap["auto_fsdp"]["reason"]
    assert "optimizers = (AdamW, ...) holds 39 parameter(s) of the unsharded model" in trap["stale_optimizer_error"]
    assert "optimizer_cls_and_kwargs" in trap["stale_optimizer_error"]
    early = trap["forward_before_train"]  # a forward before train(): the units are resharded for the optimizer
    assert early["error"] is None and math.isfinite(early["losses"]["1"]), early


# ------------------------------------------------------------------------------------------ accelerate launch
def test_accelerate_launch_with_the_shipped_fsdp2_yaml(tmp_path, cpu_kind):
    """The documented command, on CPU: the YAML's FSDP is ignored by accelerate there, hf_speedup shards.

    ``--mixed_precision no`` is the launcher's choice, and the plan keeps it on every CPU, also where ``auto``
    alone would pick bf16 (AMX); the reference is planned under the same launcher setting (like with like).
    """
    out = tmp_path / "acc"
    cmd = [executable("accelerate"), "launch", "--config_file", "configs/accelerate/fsdp2_full_shard.yaml",
           "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", "0",
           str(SCRIPT), "--out", str(out), "--phases", "main"]
    ranks = _launch(cmd, out, {FAKE_CPU_AMX: os.environ[FAKE_CPU_AMX]})
    reference, dtype = _reference(tmp_path / "reference", {"ACCELERATE_MIXED_PRECISION": "no"})
    assert dtype == "fp32"
    for res in ranks:
        m = res["main"]
        assert m["compute_dtype"] == "fp32" and "launcher's mixed_precision=no" in m["precision_reason"]
        assert m["all_dtensor"] and m["wrapped_class"] == "FSDPLlamaForCausalLM"
        assert m["summary"]["this_rank_bytes"] == FULL_BYTES // 2
        assert m["decision"]["engaged"] is True
        assert "the accelerate launch config enables FSDP too" in m["decision"]["reason"]
        got = {int(k): v for k, v in m["losses"].items()}
        assert max(abs(got[s] - reference[s]) for s in got) < _tolerance(res)


@pytest.mark.slow
def test_compile_composes_with_fsdp2(tmp_path, run):
    """Inductor-compiled blocks (in place) sharded afterwards: same losses as the eager sharded run."""
    out = tmp_path / "compile"
    ranks = _launch([executable("torchrun"), "--standalone", "--nproc_per_node", "2", str(SCRIPT), "--out", str(out),
                     "--phases", "compile"], out, NO_AMX)  # fp32 like the eager run it is compared with
    eager = run[1][0]["full"]["losses"]  # the eager sharded run with the same 4-step schedule
    for res in ranks:
        c = res["compile"]
        assert c["compile"]["engaged"] is True and c["decision"]["engaged"] is True and c["all_dtensor"]
        for step, loss in c["losses"].items():
            assert abs(loss - eager[step]) < 1e-3
