"""The FSDP decision (pure, fake capabilities), its TrainingArguments for accelerate, and the checks that need no
process group. The real sharded run is tests/test_fsdp_distributed.py."""

from __future__ import annotations

import pytest
import torch

from hf_speedup import build_plan, get_preset
from hf_speedup.config import SpeedupConfigError
from hf_speedup.features import Setup, fsdp
from hf_speedup.features.fsdp import Mesh, MixedPrecision
from hf_speedup.features.fsdp.shard import ShardSpec
from hf_speedup.features.fsdp.summary import _chunks, describe, sharding_summary
from hf_speedup.plan_types import FeatureState, Outcome

from conftest import CUDA_H100, CUDA_V100, fake_caps

CPU2 = dict(device_type="cpu", device_name="cpu", world_size=2, compile=True)


@pytest.fixture(autouse=True)
def _clean_launch_env(monkeypatch):
    """No launcher variables leak in (or out: TrainingArguments(fsdp=...) sets FSDP_CPU_RAM_EFFICIENT_LOADING)."""
    for var in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "ACCELERATE_USE_FSDP", "FSDP_VERSION",
                "FSDP_OFFLOAD_PARAMS", "FSDP_STATE_DICT_TYPE", "ACCELERATE_USE_PARALLELISM_CONFIG",
                "PARALLELISM_CONFIG_DP_REPLICATE_SIZE", "PARALLELISM_CONFIG_DP_SHARD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")


def launched(monkeypatch, local_world=None):
    monkeypatch.setenv("LOCAL_RANK", "0")
    if local_world:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))


def fsdp_cfg(**fs):
    return get_preset("fsdp").replace(fsdp=fs) if fs else get_preset("fsdp")


# ------------------------------------------------------------------------------------------ off / not possible
def test_off_unless_requested():
    d = build_plan("auto", fake_caps(**CPU2))["fsdp"]
    assert (d.applied, d.active) == ("off", False)
    assert d.reason == "not requested (fsdp.enabled: false)"


def test_one_cpu_process_has_nothing_to_shard():
    d = build_plan("fsdp", fake_caps(device_type="cpu"))["fsdp"]
    assert d.applied == "off"
    assert "world size 1: FSDP on one CPU process has nothing to shard across" in d.reason
    assert "torchrun --nproc_per_node 2" in d.reason
    assert d.fallbacks  # reported, never silent


def test_one_gpu_needs_a_distributed_launch(monkeypatch):
    d = build_plan("fsdp", fake_caps(**CUDA_H100))["fsdp"]
    assert d.applied == "off" and "torchrun --nproc_per_node 1" in d.reason
    launched(monkeypatch)
    d = build_plan("fsdp", fake_caps(**CUDA_H100))["fsdp"]  # world size 1 under torchrun: legit (NCCL check)
    assert (d.applied, d.settings.backend) == ("fsdp2", "accelerate")


def test_mps_is_refused_with_the_reason():
    d = build_plan("fsdp", fake_caps(device_type="mps", world_size=2))["fsdp"]
    assert d.applied == "off" and "FSDP is not supported on mps" in d.reason


def test_the_cpu_trap_is_reported_not_hidden(make_args):
    """TrainingArguments.fsdp on CPU trains with DDP (accelerate enables FSDP only on accelerators)."""
    args = make_args(fsdp=True, fsdp_config={"version": 2})
    d = build_plan("auto", fake_caps(**CPU2), args=args)["fsdp"]
    assert d.applied == "off"
    assert "does NOT shard on CPU" in d.reason and "plain DDP" in d.reason and "speedup='fsdp'" in d.reason
    assert d.fallbacks


def test_8bit_base_cannot_be_sharded(monkeypatch):
    launched(monkeypatch)
    cfg = get_preset("fsdp").replace(lora={"enabled": True, "quantization": "8bit"})
    with pytest.raises(SpeedupConfigError, match=r"FSDP cannot shard Int8 weights.*fix: set lora.quantization: '4bit'"):
        build_plan(cfg, fake_caps(**{**CUDA_H100, "world_size": 2}))
    build_plan(cfg, fake_caps(**CPU2))  # on CPU the lora feature already fell back to plain LoRA: nothing to refuse


# ------------------------------------------------------------------------------------------ CPU: hf_speedup backend
def test_cpu_processes_are_sharded_by_hf_speedup(tiny_model):
    d = build_plan("fsdp", fake_caps(**CPU2), tiny_model)["fsdp"]
    st = d.settings
    assert (d.applied, st.backend, st.version, st.strategy) == ("fsdp2", "hf_speedup", 2, "full_shard")
    assert st.reshard_after_forward is True
    assert st.mesh == Mesh(shape=(2,), dim_names=("dp_shard",))
    assert FeatureState(d, Outcome()).to_dict()["settings"]["mesh"] == {"shape": [2], "dim_names": ["dp_shard"]}
    assert st.wrap.block_class == "LlamaDecoderLayer" and st.wrap.blocks == 4
    assert st.mixed_precision is None  # fp32 here: nothing to cast
    assert fsdp.training_args(d, None) == {}  # TrainingArguments cannot express it: SpeedupTrainer shards


def test_fsdp1_on_cpu_becomes_fsdp2_and_says_so():
    d = build_plan(fsdp_cfg(version=1), fake_caps(**CPU2))["fsdp"]
    assert d.settings.version == 2
    assert any("fsdp.version 1 -> 2" in f for f in d.fallbacks)


@pytest.mark.parametrize("strategy, reshard, mesh", [
    ("full_shard", True, [4]),
    ("shard_grad_op", False, [4]),
    ("hybrid_shard", True, [2, 2]),  # 2 nodes x 2 processes: replicate across, shard within
    ("no_shard", True, [4, 1]),  # FSDP2 equivalent of NO_SHARD: a shard dimension of size 1
])
def test_strategies_map_to_fsdp2(strategy, reshard, mesh, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    d = build_plan(fsdp_cfg(strategy=strategy), fake_caps(device_type="cpu", world_size=4))["fsdp"]
    assert d.settings.reshard_after_forward is reshard
    assert d.settings.mesh.shape == tuple(mesh)
    spec = ShardSpec.from_settings(d.settings)
    assert (spec.mesh_shape, spec.reshard_after_forward) == (tuple(mesh), reshard)


def test_hybrid_needs_equal_processes_per_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(SpeedupConfigError, match=r"'hybrid_shard' needs the world size \(3\) to be a multiple"):
        build_plan(fsdp_cfg(strategy="hybrid_shard"), fake_caps(device_type="cpu", world_size=3))


def test_hybrid_on_one_node_is_a_full_shard_and_says_so(monkeypatch):
    d = build_plan(fsdp_cfg(strategy="hybrid_shard"), fake_caps(**CPU2))["fsdp"]
    assert d.settings.mesh.shape == (1, 2)
    assert any("hybrid_shard on one node = full_shard" in f for f in d.fallbacks)


def test_launcher_hsdp_topology_is_respected(monkeypatch):
    launched(monkeypatch)
    for k, v in {"ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": "true",
                 "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
                 "PARALLELISM_CONFIG_DP_SHARD_SIZE": "8"}.items():
        monkeypatch.setenv(k, v)
    d = build_plan("fsdp", fake_caps(**{**CUDA_H100, "world_size": 16}))["fsdp"]
    assert d.settings.strategy == "hybrid_shard"
    assert d.settings.parallelism == (2, 8)  # (dp_replicate_size, dp_shard_size)
    assert any("full_shard -> hybrid_shard" in f for f in d.fallbacks)
    assert "it differs: fsdp_offload_params=true (preset: false)" in d.reason
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "4")
    with pytest.raises(SpeedupConfigError, match=r"dp_replicate_size=2 x dp_shard_size=4, but 16 processes run"):
        build_plan("fsdp", fake_caps(**{**CUDA_H100, "world_size": 16}))


def test_cpu_offload_on_cpu_is_honest():
    d = build_plan("fsdp-offload", fake_caps(**CPU2))["fsdp"]
    assert d.settings.cpu_offload is True
    assert "parameters already live in host memory" in d.reason


# ------------------------------------------------------------------------------------------ CUDA: accelerate backend
def test_cuda_uses_accelerate_through_training_arguments(monkeypatch, tiny_model, make_args):
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

    from hf_speedup.features.fsdp.trainer_hooks import FsdpTrainerMixin

    args = make_args(use_cpu=False)  # (use_cpu=True would mean: the CPU path, whatever the machine has)
    launched(monkeypatch)
    plan = build_plan("fsdp", fake_caps(**{**CUDA_H100, "world_size": 8}), tiny_model, args)
    d = plan["fsdp"]
    assert d.settings.backend == "accelerate"
    assert d.settings.mixed_precision == MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    over = fsdp.training_args(d, args)
    assert over["fsdp"] is True
    cfg = over["fsdp_config"]
    assert cfg["version"] == 2 and cfg["reshard_after_forward"] is True
    assert cfg["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]  # the block finder's class
    assert cfg["state_dict_type"] == "SHARDED_STATE_DICT" and cfg["cpu_offload"] is False

    # what the Trainer turns it into: accelerate's plugin, plus our fp32-reduce mixed-precision policy
    monkeypatch.delenv("LOCAL_RANK")
    targs = make_args(use_cpu=False, **over)
    trainer = FsdpTrainerMixin.__new__(FsdpTrainerMixin)
    trainer.args, trainer.speedup_plan = targs, plan
    trainer._speedup_fsdp_plugin_args(d)
    plugin = FullyShardedDataParallelPlugin(**targs.fsdp_plugin_args)
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert plugin.mixed_precision_policy == MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.bfloat16)


def test_fp16_gpu_gets_an_fp16_policy(monkeypatch):
    launched(monkeypatch)
    d = build_plan("fsdp", fake_caps(**{**CUDA_V100, "world_size": 2}))["fsdp"]
    assert d.settings.mixed_precision == MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)


def test_no_shard_through_accelerate_falls_back_to_fsdp1(monkeypatch, make_args):
    launched(monkeypatch)
    d = build_plan(fsdp_cfg(strategy="no_shard"), fake_caps(**{**CUDA_H100, "world_size": 2}))["fsdp"]
    assert d.applied == "fsdp1"
    assert any("FSDP2 has no NO_SHARD" in f for f in d.fallbacks)
    cfg = fsdp.training_args(d, None)["fsdp_config"]
    assert (cfg["version"], cfg["reshard_after_forward"], cfg["use_orig_params"]) == (1, "no_shard", True)
    monkeypatch.delenv("LOCAL_RANK")
    targs = make_args(**fsdp.training_args(d, None))
    assert targs.fsdp_plugin_args["fsdp_version"] == 1
    assert targs.fsdp_plugin_args["reshard_after_forward"] == "no_shard"
    assert targs.fsdp_plugin_args["use_orig_params"] is True


def test_hybrid_through_accelerate_is_hsdp_via_parallelism_config(monkeypatch):
    launched(monkeypatch, local_world=8)
    d = build_plan(fsdp_cfg(strategy="hybrid_shard"), fake_caps(**{**CUDA_H100, "world_size": 16}))["fsdp"]
    pc = fsdp.training_args(d, None)["parallelism_config"]
    assert (pc.dp_replicate_size, pc.dp_shard_size) == (2, 8)


# ------------------------------------------------------------------------------------------ hand-offs
def test_activation_checkpointing_is_done_once(monkeypatch):
    cfg = get_preset("fsdp").replace(checkpointing={"enabled": True})
    launched(monkeypatch)
    plan = build_plan(cfg, fake_caps(**{**CUDA_H100, "world_size": 2}))
    assert plan["fsdp"].settings.activation_checkpointing is True  # FSDP's own, through fsdp_config
    assert fsdp.training_args(plan["fsdp"], None)["fsdp_config"]["activation_checkpointing"] is True
    assert plan["checkpointing"].settings.by == "fsdp"  # ... so the checkpointing feature stays out
    monkeypatch.delenv("LOCAL_RANK")
    plan = build_plan(cfg, fake_caps(**CPU2))  # CPU: the checkpointing feature does it, before sharding
    assert plan["fsdp"].settings.activation_checkpointing is False
    assert plan["fsdp"].settings.activation_checkpointing_by == "checkpointing"
    assert plan["checkpointing"].settings.by == "hf_speedup"


def test_selective_checkpointing_stays_with_the_checkpointing_feature(monkeypatch):
    launched(monkeypatch)
    cfg = get_preset("fsdp").replace(checkpointing={"enabled": True, "every_n_blocks": 2})
    d = build_plan(cfg, fake_caps(**{**CUDA_H100, "world_size": 2}))["fsdp"]
    assert d.settings.activation_checkpointing is False
    assert "every_n_blocks > 1 is not expressible in fsdp_config" in d.reason


def test_qlora_under_fsdp_publishes_the_storage_dtype(monkeypatch):
    launched(monkeypatch)
    plan = build_plan("fsdp", fake_caps(**{**CUDA_H100, "world_size": 2}))
    assert plan["fsdp"].settings.qlora_quant_storage is None
    cfg = get_preset("fsdp").replace(lora={"enabled": True, "quantization": "4bit"})
    d = build_plan(cfg, fake_caps(**{**CUDA_H100, "world_size": 2}))["fsdp"]
    assert d.settings.qlora_quant_storage is torch.bfloat16
    assert d.settings.lora is True and d.settings.cpu_ram_efficient_loading is True
    assert "FSDP_CPU_RAM_EFFICIENT_LOADING=true before from_pretrained" in d.reason


def test_uint8_4bit_storage_is_refused_with_the_fix(tiny_model):
    class Params4bit(torch.nn.Parameter):  # stands in for bitsandbytes' class (matched by name)
        pass

    tiny_model.model.layers[0].mlp.up_proj.weight = Params4bit(torch.zeros(8, dtype=torch.uint8), requires_grad=False)
    d = build_plan("fsdp", fake_caps(**CPU2), tiny_model)["fsdp"]
    with pytest.raises(SpeedupConfigError, match=r"stored as uint8.*bnb_4bit_quant_storage=torch\.bfloat16"):
        fsdp.apply(d, Setup(model=tiny_model, args=None), Outcome())


# ------------------------------------------------------------------------------------------ verification
def test_verify_refuses_an_unsharded_model(tiny_model):
    class FakeTrainer:
        model = tiny_model
        model_wrapped = tiny_model

    d = build_plan("fsdp", fake_caps(**CPU2), tiny_model)["fsdp"]
    assert fsdp.verify(d, FakeTrainer(), Outcome()) == (False, "NOT sharded: no parameter is a DTensor")

    class DistributedDataParallel(torch.nn.Module):  # what the stock Trainer wraps the model in
        pass

    FakeTrainer.model_wrapped = DistributedDataParallel()
    engaged, reason = fsdp.verify(d, FakeTrainer(), Outcome())
    assert not engaged and reason == "NOT sharded: the Trainer wrapped the model in DistributedDataParallel"


def test_summary_of_a_plain_model_counts_the_whole_model(tiny_model):
    s = sharding_summary(tiny_model)
    n = sum(p.numel() for p in tiny_model.parameters())
    assert (s["dtensor_parameters"], s["units"], s["sharded"]) == (0, 0, False)
    assert s["total_bytes"] == s["this_rank_bytes"] == 4 * n
    assert describe({**s, "units": 7, "world_size": 2, "rank_bytes": {0: 427136, 1: 427136}, "total_bytes": 854272},
                    "full_shard") == "FSDP2 full_shard: 7 units, 2 ranks, 427.1 KB/rank of 854.3 KB"


def test_dtensor_shard_sizes_follow_torch_chunk():
    assert _chunks(512, 2) == [256, 256]
    assert _chunks(5, 2) == [3, 2]
    assert _chunks(1, 4) == [1, 0, 0, 0]  # ranks past the data hold empty shards
    for size, n in [(7, 3), (64, 8), (3, 5)]:
        chunks = [len(c) for c in torch.arange(size).chunk(n)]
        assert _chunks(size, n) == chunks + [0] * (n - len(chunks))


def test_fsdp_presets_exist_and_validate():
    for name in ("fsdp", "fsdp-offload", "fsdp-lora"):
        cfg = get_preset(name)
        assert cfg.fsdp.enabled and cfg.fsdp.version == 2
    assert get_preset("fsdp-offload").fsdp.cpu_offload and get_preset("fsdp-offload").checkpointing.enabled is True
    assert get_preset("fsdp-lora").lora.enabled


def test_launcher_hsdp_conflicts_with_no_shard(monkeypatch):
    launched(monkeypatch)
    for k, v in {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
                 "PARALLELISM_CONFIG_DP_SHARD_SIZE": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SpeedupConfigError, match=r"'no_shard' conflicts with the accelerate launch config's HSDP"):
        build_plan(fsdp_cfg(strategy="no_shard"), fake_caps(**{**CUDA_H100, "world_size": 2}))


def test_use_cpu_on_a_gpu_machine_takes_the_cpu_path(make_args):
    d = build_plan("fsdp", fake_caps(**{**CUDA_H100, "world_size": 2}), args=make_args(use_cpu=True))["fsdp"]
    assert d.settings.backend == "hf_speedup"


def test_fsdp_arguments_for_old_and_new_transformers():
    from hf_speedup import compat

    class Legacy:  # a 4.x TrainingArguments: no _apply_legacy_fsdp_to_config, options in the fsdp string
        pass

    cfg = {"version": 2, "cpu_offload": True, "reshard_after_forward": True}
    assert compat.fsdp_training_args(cfg, "full_shard", True, Legacy) == {
        "fsdp": "full_shard auto_wrap offload", "fsdp_config": {"version": 2, "reshard_after_forward": True}}
    assert compat.fsdp_training_args(cfg, "full_shard", True) == {"fsdp": True, "fsdp_config": cfg}
    assert compat.fsdp2_support()[0] is True  # torch 2.13 + accelerate 1.15
