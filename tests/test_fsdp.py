"""The FSDP decision (pure, fake capabilities), its TrainingArguments for accelerate, and the checks that need no
process group. The real sharded run is tests/test_fsdp_distributed.py."""

from __future__ import annotations

import pytest
import torch

from hf_speedup import plan_for, get_preset
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
    d = plan_for("auto", fake_caps(**CPU2))["fsdp"]
    assert (d.applied, d.active) == ("off", False)
    assert d.reason == "not requested (fsdp.enabled: false)"


def test_one_cpu_process_has_nothing_to_shard():
    d = plan_for("fsdp", fake_caps(device_type="cpu"))["fsdp"]
    assert d.applied == "off"
    assert "world size 1: FSDP on one CPU process has nothing to shard across" in d.reason
    assert "torchrun --nproc_per_node 2" in d.reason
    assert d.fallbacks  # reported, never silent


def test_one_gpu_needs_a_distributed_launch(monkeypatch):
    d = plan_for("fsdp", fake_caps(**CUDA_H100))["fsdp"]
    assert d.applied == "off" and "torchrun --nproc_per_node 1" in d.reason
    launched(monkeypatch)
    d = plan_for("fsdp", fake_caps(**CUDA_H100))["fsdp"]  # world size 1 under torchrun: legit (NCCL check)
    assert (d.applied, d.settings.backend) == ("fsdp2", "accelerate")


def test_mps_is_refused_with_the_reason():
    d = plan_for("fsdp", fake_caps(device_type="mps", world_size=2))["fsdp"]
    assert d.applied == "off" and "FSDP is not supported on mps" in d.reason


def test_the_cpu_trap_is_reported_not_hidden(make_args):
    """TrainingArguments.fsdp on CPU trains with DDP (accelerate enables FSDP only on accelerators)."""
    args = make_args(fsdp=True, fsdp_config={"version": 2})
    d = plan_for("auto", fake_caps(**CPU2), args=args)["fsdp"]
    assert d.applied == "off"
    assert "does NOT shard on CPU" in d.reason and "plain DDP" in d.reason and "speedup='fsdp'" in d.reason
    assert d.fallbacks


def test_8bit_base_cannot_be_sharded(monkeypatch):
    launched(monkeypatch)
    cfg = get_preset("fsdp").replace(lora={"enabled": True, "quantization": "8bit"})
    with pytest.raises(SpeedupConfigError, match=r"FSDP cannot shard Int8 weights.*fix: set lora.quantization: '4bit'"):
        plan_for(cfg, fake_caps(**{**CUDA_H100, "world_size": 2}))
    plan_for(cfg, fake_caps(**CPU2))  # on CPU the lora feature already fell back to plain LoRA: nothing to refuse


# ------------------------------------------------------------------------------------------ CPU: hf_speedup backend
def test_cpu_processes_are_sharded_by_hf_speedup(tiny_model):
    d = plan_for("fsdp", fake_caps(**CPU2), tiny_model)["fsdp"]
    st = d.settings
    assert (d.applied, st.backend, st.version, st.strategy) == ("fsdp2", "hf_speedup", 2, "full_shard")
    assert st.reshard_after_forward is True
    assert st.mesh == Mesh(shape=(2,), dim_names=("dp_shard",))
    assert FeatureState(d, Outcome()).to_dict()["settings"]["mesh"] == {"shape": [2], "dim_names": ["dp_shard"]}
    assert st.wrap.block_class == "LlamaDecoderLayer" and st.wrap.blocks == 4
    assert st.mixed_precision is None  # fp32 here: nothing to cast
    assert fsdp.training_args(d, None) == {}  # TrainingArguments cannot express it: SpeedupTrainer shards


@pytest.mark.parametrize("preset", ["fsdp", "auto", "baseline"])
def test_several_cpu_processes_without_use_cpu_are_refused_before_any_work(preset, make_args, tiny_model):
    """Without use_cpu=True each CPU rank's TrainingArguments see a world of one: every rank would train on all the
    rows (FSDP sharding the model across them regardless) and save into the same folder."""
    args = make_args()
    args.use_cpu = False  # a copy would set the process's accelerator state up again
    with pytest.raises(SpeedupConfigError, match=r"TrainingArguments.use_cpu = False on 2 CPU processes "
                                                  r"\(WORLD_SIZE=2\): .*every rank trains on all the rows.*allowed: "
                                                  r"use_cpu=True .*fix: TrainingArguments\(use_cpu=True"):
        plan_for(preset, fake_caps(**CPU2), tiny_model, args)
    args.use_cpu = True
    assert plan_for(preset, fake_caps(**CPU2), tiny_model, args)["fsdp"].active is (preset == "fsdp")


def test_fsdp1_on_cpu_becomes_fsdp2_and_says_so():
    d = plan_for(fsdp_cfg(version=1), fake_caps(**CPU2))["fsdp"]
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
    d = plan_for(fsdp_cfg(strategy=strategy), fake_caps(device_type="cpu", world_size=4))["fsdp"]
    assert d.settings.reshard_after_forward is reshard
    assert d.settings.mesh.shape == tuple(mesh)
    spec = ShardSpec.from_settings(d.settings)
    assert (spec.mesh_shape, spec.reshard_after_forward) == (tuple(mesh), reshard)


def test_hybrid_needs_equal_processes_per_node(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(SpeedupConfigError, match=r"'hybrid_shard' needs the world size \(3\) to be a multiple"):
        plan_for(fsdp_cfg(strategy="hybrid_shard"), fake_caps(device_type="cpu", world_size=3))


def test_hybrid_on_one_node_is_a_full_shard_and_says_so(monkeypatch):
    d = plan_for(fsdp_cfg(strategy="hybrid_shard"), fake_caps(**CPU2))["fsdp"]
    assert d.settings.mesh.shape == (1, 2)
    assert any("hybrid_shard on one node = full_shard" in f for f in d.fallbacks)


def test_launcher_hsdp_topology_is_respected(monkeypatch):
    launched(monkeypatch)
    for k, v in {"ACCELERATE_USE_FSDP": "true", "FSDP_OFFLOAD_PARAMS": "true",
                 "ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "2",
                 "PARALLELISM_CONFIG_DP_SHARD_SIZE": "8"}.items():
        monkeypatch.setenv(k, v)
    d = plan_for("fsdp", fake_caps(**{**CUDA_H100, "world_size": 16}))["fsdp"]
    assert d.settings.strategy == "hybrid_shard"
    assert d.settings.parallelism == (2, 8)  # (dp_replicate_size, dp_shard_size)
    assert any("full_shard -> hybrid_shard" in f for f in d.fallbacks)
    assert "it differs: fsdp_offload_params=true (preset: false)" in d.reason
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", "4")
    with pytest.raises(SpeedupConfigError, match=r"dp_replicate_size=2 x dp_shard_size=4, but 16 processes run"):
        plan_for("fsdp", fake_caps(**{**CUDA_H100, "world_size": 16}))


def test_cpu_offload_on_cpu_is_honest():
    d = plan_for("fsdp-offload", fake_caps(**CPU2))["fsdp"]
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
    plan = plan_for("fsdp", fake_caps(**{**CUDA_H100, "world_size": 8}), tiny_model, args)
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
    d = plan_for("fsdp", fake_caps(**{**CUDA_V100, "world_size": 2}))["fsdp"]
    assert d.settings.mixed_precision == MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)


def test_no_shard_through_accelerate_falls_back_to_fsdp1(monkeypatch, make_args):
    launched(monkeypatch)
    d = plan_for(fsdp_cfg(strategy="no_shard"), fake_caps(**{**CUDA_H100, "world_size": 2}))["fsdp"]
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
    d = plan_for(fsdp_cfg(strategy="hybrid_shard"), fake_caps(**{**CUDA_H100, "world_size": 16}))["fsdp"]
    pc = fsdp.training_args(d, None)["parallelism_config"]
    assert (pc.dp_replicate_size, pc.dp_shard_size) == (2, 8)


# ------------------------------------------------------------------------------------------ hand-offs
def test_activation_checkpointing_is_done_once(monkeypatch):
    cfg = get_preset("fsdp").replace(checkpointing={"enabled": True})
    launched(monkeypatch)
    plan = plan_for(cfg, fake_caps(**{**CUDA_H100, "world_size": 2}))
    assert plan["fsdp"].settings.activation_checkpointing is True  # FSDP's own, through fsdp_config
    assert fsdp.training_args(plan["fsdp"], None)["fsdp_config"]["activation_checkpointing"] is True
    assert plan["checkpointing"].settings.by == "fsdp"  # ... so the checkpointing feature stays out
    monkeypatch.delenv("LOCAL_RANK")
    plan = plan_for(cfg, fake_caps(**CPU2))  # CPU: the checkpointing feature does it, before sharding
    assert plan["fsdp"].settings.activation_checkpointing is False
    assert plan["fsdp"].settings.activation_checkpointing_by == "checkpointing"
    assert plan["checkpointing"].settings.by == "hf_speedup"


def test_selective_checkpointing_stays_with_the_checkpointing_feature(monkeypatch):
    launched(monkeypatch)
    cfg = get_preset("fsdp").replace(checkpointing={"enabled": True, "every_n_blocks": 2})
    d = plan_for(cfg, fake_caps(**{**CUDA_H100, "world_size": 2}))["fsdp"]
    assert d.settings.activation_checkpointing is False
    assert "every_n_blocks > 1 is not expressible in fsdp_config" in d.reason


def test_qlora_under_fsdp_publishes_the_storage_dtype(monkeypatch):
    launched(monkeypatch)
    plan = plan_for("fsdp", fake_caps(**{**CUDA_H100, "world_size": 2}))
    assert plan["fsdp"].settings.qlora_quant_storage is None
    cfg = get_preset("fsdp").replace(lora={"enabled": True, "quantization": "4bit"})
    d = plan_for(cfg, fake_caps(**{**CUDA_H100, "world_size": 2}))["fsdp"]
    assert d.settings.qlora_quant_storage is torch.bfloat16
    assert d.settings.lora is True and d.settings.cpu_ram_efficient_loading is True
    assert "FSDP_CPU_RAM_EFFICIENT_LOADING=true before from_pretrained" in d.reason


def test_uint8_4bit_storage_is_refused_with_the_fix(tiny_model):
    class Params4bit(torch.nn.Parameter):  # stands in for bitsandbytes' class (matched by name)
        pass

    tiny_model.model.layers[0].mlp.up_proj.weight = Params4bit(torch.zeros(8, dtype=torch.uint8), requires_grad=False)
    d = plan_for("fsdp", fake_caps(**CPU2), tiny_model)["fsdp"]
    with pytest.raises(SpeedupConfigError, match=r"stored as uint8.*bnb_4bit_quant_storage=torch\.bfloat16"):
        fsdp.apply(d, Setup(model=tiny_model, args=None), Outcome())


# ------------------------------------------------------------------------------------------ verification
def test_verify_refuses_an_unsharded_model(tiny_model):
    class FakeTrainer:
        model = tiny_model
        model_wrapped = tiny_model

    d = plan_for("fsdp", fake_caps(**CPU2), tiny_model)["fsdp"]
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
        plan_for(fsdp_cfg(strategy="no_shard"), fake_caps(**{**CUDA_H100, "world_size": 2}))


def test_use_cpu_on_a_gpu_machine_takes_the_cpu_path(make_args):
    d = plan_for("fsdp", fake_caps(**{**CUDA_H100, "world_size": 2}), args=make_args(use_cpu=True))["fsdp"]
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


# ------------------------------------------------------------------------------------------ accelerate's live plugin
@pytest.fixture
def fake_world_of_two():
    """A two-rank process group in this one process (torch's fake backend: collectives do nothing), so FSDP1
    really shards a model here and the live FlatParameters show what each rank would hold."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def _plugin(monkeypatch, make_args, decision, plan, **env):
    """accelerate's FSDP plugin as SpeedupTrainer builds it: TrainingArguments from the decision, the
    trainer hook's additions, then the launch environment ``env`` (what ``accelerate launch`` exports)."""
    import accelerate.utils.dataclasses as accelerate_dataclasses
    from accelerate.utils import FullyShardedDataParallelPlugin

    from hf_speedup.features.fsdp.trainer_hooks import FsdpTrainerMixin

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    targs = make_args(**fsdp.training_args(decision, None))
    trainer = FsdpTrainerMixin.__new__(FsdpTrainerMixin)
    trainer.args, trainer.speedup_plan = targs, plan
    trainer._speedup_fsdp_plugin_args(decision)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # FSDP1 sync_module_states asks for a device id
    monkeypatch.setattr(accelerate_dataclasses, "is_cuda_available", lambda: True)
    return FullyShardedDataParallelPlugin(**targs.fsdp_plugin_args)


def _wrap_fsdp1(model, plugin):
    """What Accelerator.prepare_model does with an FSDP1 plugin (accelerator.py: sharding_strategy first)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model, sharding_strategy=plugin.sharding_strategy or plugin.reshard_after_forward,
                cpu_offload=plugin.cpu_offload, use_orig_params=plugin.use_orig_params,
                device_id=torch.device("cpu"))


def test_fsdp1_no_shard_reaches_the_live_model(monkeypatch, make_args, tiny_model, fake_world_of_two):
    from torch.distributed.fsdp import MixedPrecision as Fsdp1MixedPrecision
    from torch.distributed.fsdp import ShardingStrategy

    launched(monkeypatch)
    plan = plan_for(fsdp_cfg(strategy="no_shard"), fake_caps(**{**CUDA_H100, "world_size": 2}))
    d = plan["fsdp"]
    # the launcher exports FSDP_SHARDING_STRATEGY=FULL_SHARD unless the YAML says otherwise
    plugin = _plugin(monkeypatch, make_args, d, plan, FSDP_SHARDING_STRATEGY="FULL_SHARD", FSDP_VERSION="1")
    assert plugin.sharding_strategy == ShardingStrategy.NO_SHARD
    # the reason's "reduce float32" holds for FSDP1 too
    assert "reduce float32" in d.reason
    assert plugin.mixed_precision_policy == Fsdp1MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)

    class FakeTrainer:
        model = model_wrapped = _wrap_fsdp1(tiny_model, plugin)

    engaged, reason = fsdp.verify(d, FakeTrainer(), Outcome())
    assert engaged, reason
    assert reason.endswith("(replicated on purpose: no_shard)")


def test_verify_catches_no_shard_that_runs_sharded(tiny_model, fake_world_of_two, monkeypatch):
    from accelerate.utils import FullyShardedDataParallelPlugin

    launched(monkeypatch)
    d = plan_for(fsdp_cfg(strategy="no_shard"), fake_caps(**{**CUDA_H100, "world_size": 2}))["fsdp"]
    monkeypatch.delenv("LOCAL_RANK")

    class FakeTrainer:  # what accelerate did before: FULL_SHARD from the launch environment
        model = model_wrapped = _wrap_fsdp1(tiny_model, FullyShardedDataParallelPlugin(
            fsdp_version=1, sharding_strategy="FULL_SHARD", use_orig_params=True))

    engaged, reason = fsdp.verify(d, FakeTrainer(), Outcome())
    assert not engaged and "NOT no_shard — FSDP1 runs FULL_SHARD" in reason, reason


def test_launch_yaml_offload_does_not_override_the_preset(monkeypatch, make_args, tiny_model, fake_world_of_two):
    from torch.distributed.fsdp import CPUOffloadPolicy

    launched(monkeypatch)
    for k, v in {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_OFFLOAD_PARAMS": "true"}.items():
        monkeypatch.setenv(k, v)  # configs/accelerate/fsdp2_offload.yaml under accelerate launch
    plan = plan_for("fsdp", fake_caps(**{**CUDA_H100, "world_size": 8}), tiny_model)
    d = plan["fsdp"]
    assert d.settings.cpu_offload is False and "fsdp_offload_params=true (preset: false)" in d.reason
    plugin = _plugin(monkeypatch, make_args, d, plan)
    assert not isinstance(plugin.cpu_offload, CPUOffloadPolicy)  # the preset's false wins, as the reason says

    # and verify flags offload nobody asked for (FSDP1 says so on its live modules)
    from accelerate.utils import FullyShardedDataParallelPlugin

    monkeypatch.delenv("FSDP_VERSION")
    v1 = FullyShardedDataParallelPlugin(fsdp_version=1, sharding_strategy="FULL_SHARD", use_orig_params=True)
    assert v1.cpu_offload.offload_params is True  # from FSDP_OFFLOAD_PARAMS

    class FakeTrainer:
        model = model_wrapped = _wrap_fsdp1(tiny_model, v1)

    engaged, reason = fsdp.verify(d, FakeTrainer(), Outcome())
    assert not engaged and "CPU offload in force but NOT asked for" in reason, reason


def test_every_block_class_of_a_vision_language_model_is_wrapped(monkeypatch, make_args):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    cfg = Qwen2VLConfig(
        text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2))
    model = Qwen2VLForConditionalGeneration(cfg)
    launched(monkeypatch)
    plan = plan_for("fsdp", fake_caps(**{**CUDA_H100, "world_size": 2}), model)
    d = plan["fsdp"]
    want = ["Qwen2VLVisionBlock", "Qwen2VLDecoderLayer"]
    assert fsdp.training_args(d, None)["fsdp_config"]["transformer_layer_cls_to_wrap"] == want
    assert "each Qwen2VLVisionBlock, Qwen2VLDecoderLayer" in d.reason
    plugin = _plugin(monkeypatch, make_args, d, plan)
    assert plugin.transformer_cls_names_to_wrap == want
    plugin.set_auto_wrap_policy(model)  # what accelerate does before sharding: both classes become FSDP units
    assert {c.__name__ for c in plugin.auto_wrap_policy.keywords["transformer_layer_cls"]} == set(want)


def test_accelerate_does_not_compile_over_hf_speedups_compiled_blocks(monkeypatch, tiny_model, dataset, collator,
                                                                       make_args):
    from accelerate.utils import DynamoBackend

    from hf_speedup import SpeedupTrainer
    from hf_speedup.features.compile import guarded_regions

    for k, v in {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "True",
                 "ACCELERATE_DYNAMO_MODE": "default"}.items():
        monkeypatch.setenv(k, v)  # an accelerate launch YAML's dynamo_config
    speedup = get_preset("baseline").replace(compile={"enabled": True, "backend": "eager"})
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=1), train_dataset=dataset,
                             data_collator=collator, speedup=speedup)
    assert trainer.speedup_plan["compile"].active and len(guarded_regions(tiny_model)) == 4
    assert trainer.accelerator.state.dynamo_plugin.backend == DynamoBackend.NO
    prepared = trainer.accelerator.prepare_model(tiny_model)  # what train() does: no second compile
    assert len(guarded_regions(prepared)) == 4 and prepared is tiny_model
    state = FeatureState(trainer.speedup_plan["compile"], trainer.speedup_outcomes["compile"])
    assert "accelerate's dynamo_config (INDUCTOR, regional) turned off" in state.reason


def test_an_fsdp_launch_config_shards_a_non_fsdp_preset_and_the_report_says_so(monkeypatch, tiny_model,
                                                                                fake_world_of_two):
    from accelerate.utils import FullyShardedDataParallelPlugin

    from hf_speedup.features.fsdp.shard import shard_model

    launched(monkeypatch)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # accelerate launch with an FSDP2 YAML
    monkeypatch.setenv("FSDP_VERSION", "2")
    d = plan_for("lora", fake_caps(**{**CUDA_H100, "world_size": 2}), tiny_model)["fsdp"]
    assert d.active and d.applied == "fsdp2 (launch config)" and d.requested is False
    assert "the accelerate launch config enables FSDP2 (ACCELERATE_USE_FSDP): accelerate shards the model" in d.reason
    assert fsdp.training_args(d, None) == {}  # hf_speedup adds nothing: the launch file's settings apply
    assert FullyShardedDataParallelPlugin().fsdp_version == 2  # what accelerate builds from that environment

    class FakeTrainer:  # the live model after accelerate sharded it
        model = model_wrapped = tiny_model

    shard_model(tiny_model, ShardSpec(mesh_shape=(2,), broadcast_from_rank0=False))
    engaged, reason = fsdp.verify(d, FakeTrainer(), Outcome())
    assert engaged and reason.startswith("accelerate's FSDP from the launch config, not the preset: FSDP2 full_shard")

    cpu = plan_for("lora", fake_caps(**CPU2))["fsdp"]  # accelerate enables no FSDP on CPU: DDP, said so
    assert not cpu.active and "accelerate enables FSDP only on accelerators" in cpu.reason
