"""Every shipped accelerate YAML goes through accelerate's own loader and launcher argument pipeline.

Loading alone only checks top-level keys, so each file is also fed to ``accelerate launch``'s parser and
validation, turned into the environment the launcher gives the training processes, and the FSDP /
dynamo / parallelism plugins are built from that environment: what a training process would really get.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from hf_speedup import plan_for
from hf_speedup.accelerate_config import SHIPPED, SHIPPED_LAYOUT, accelerate_config_dict, write_accelerate_config
from hf_speedup.config import SpeedupConfigError
from hf_speedup.features.fsdp.settings import launch_file_fsdp_config
from hf_speedup.presets import get_preset

from conftest import CUDA_H100, fake_caps

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "configs" / "accelerate"
YAMLS = sorted(FOLDER.glob("*.yaml"))

# name -> (distributed_type, num_processes, num_machines, regional compile, cpu offload)
EXPECTED = {
    "single_gpu_bf16": ("NO", 1, 1, True, None),
    "multi_gpu_ddp": ("MULTI_GPU", 8, 1, True, None),
    "fsdp2_full_shard": ("FSDP", 8, 1, True, False),
    "fsdp2_offload": ("FSDP", 8, 1, False, True),
    "fsdp2_hybrid_multinode": ("FSDP", 16, 2, True, False),
    "long_context_parallel": ("FSDP", 8, 1, False, False),
}


def test_the_shipped_files_are_exactly_the_documented_set():
    assert {p.stem for p in YAMLS} == set(SHIPPED) == set(EXPECTED)


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_shipped_yaml_loads_with_accelerates_loader(path):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

    cfg = load_config_from_file(str(path))
    assert isinstance(cfg, ClusterConfig)
    dtype, n, m, compiled, offload = EXPECTED[path.stem]
    assert cfg.distributed_type.value == dtype
    assert (cfg.num_processes, cfg.num_machines) == (n, m)
    assert cfg.mixed_precision == "bf16" and cfg.use_cpu is False
    assert bool(cfg.dynamo_config) == compiled
    if dtype == "FSDP":
        assert cfg.fsdp_config["fsdp_version"] == 2
        assert cfg.fsdp_config["fsdp_offload_params"] is offload


def _launch_env(path: Path, monkeypatch) -> tuple[object, dict]:
    """``accelerate launch --config_file path train.py``: parsed, validated, turned into the child env."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env, prepare_simple_launcher_cmd_env

    parser = launch_command_parser()
    dests = {a.dest for a in parser._actions}
    raw = yaml.safe_load(path.read_text())
    for section in ("fsdp_config", "dynamo_config", "parallelism_config"):
        for key in raw.get(section) or {}:
            assert key in dests, f"{path.name}: {section}.{key} is not an accelerate launch option (ignored silently)"
    args = parser.parse_args(["--config_file", str(path), "train.py"])
    _validate_launch_command(args)
    if args.multi_gpu or args.use_fsdp:
        args.main_process_port = 0  # a free port: the test must not depend on 29500 being unused
        env = prepare_multi_gpu_env(args)
    else:
        _, env = prepare_simple_launcher_cmd_env(args)
    for key, value in env.items():
        if key.startswith(("FSDP_", "ACCELERATE_", "PARALLELISM_CONFIG_")):
            monkeypatch.setenv(key, value)
    return args, env


@pytest.mark.parametrize("path", YAMLS, ids=lambda p: p.stem)
def test_shipped_yaml_gives_the_processes_what_it_says(path, monkeypatch):
    from accelerate.utils import TorchDynamoPlugin

    dtype, n, m, compiled, offload = EXPECTED[path.stem]
    args, env = _launch_env(path, monkeypatch)
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    dynamo = TorchDynamoPlugin()
    want = ("INDUCTOR", True) if compiled else ("NO", False)
    assert (dynamo.backend.value, dynamo.use_regional_compilation) == want
    if dtype == "FSDP":
        from accelerate.utils import FullyShardedDataParallelPlugin
        from torch.distributed.fsdp import CPUOffloadPolicy
        from torch.distributed.fsdp.fully_sharded_data_parallel import StateDictType

        assert env["ACCELERATE_USE_FSDP"] == "true"
        plugin = FullyShardedDataParallelPlugin()  # from the env, as in a launched process
        assert plugin.fsdp_version == 2
        assert plugin.reshard_after_forward is True  # full shard
        assert isinstance(plugin.cpu_offload, CPUOffloadPolicy) == offload
        assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
        assert plugin.cpu_ram_efficient_loading is True
        assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"
    if m > 1:
        from accelerate import ParallelismConfig

        assert args.num_machines == 2 and args.nnodes == "2" and args.nproc_per_node == "8"
        assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true"
        pc = ParallelismConfig()  # from the env
        assert (pc.dp_replicate_size, pc.dp_shard_size) == (2, 8)  # HSDP: replicate across nodes, shard within
    elif dtype != "NO":
        assert args.nproc_per_node == str(n)
    if path.stem == "long_context_parallel":
        from accelerate import ParallelismConfig

        pc = ParallelismConfig()  # from the env, as in a launched process
        assert (pc.dp_replicate_size, pc.dp_shard_size, pc.cp_size) == (1, 4, 2) and pc.cp_enabled


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_yaml_is_what_the_generator_writes(name, tmp_path):
    """The files never drift from hf_speedup.accelerate_config (regenerate: write_shipped_configs())."""
    preset, overrides, n, m = SHIPPED[name]
    cfg = get_preset(preset).replace(**overrides) if overrides else get_preset(preset)
    cfg.name = preset
    out = write_accelerate_config(cfg, n, m, tmp_path / f"{name}.yaml", name=name, **SHIPPED_LAYOUT.get(name, {}))
    assert out.read_text() == (FOLDER / f"{name}.yaml").read_text()


@pytest.mark.parametrize("name", sorted(n for n in SHIPPED if SHIPPED[n][0].startswith("fsdp")))
def test_shipped_fsdp_options_are_what_a_launched_run_decides(name, monkeypatch):
    """The files and the Trainer path share one producer: the plan of a run launched on that layout."""
    preset, overrides, n, m = SHIPPED[name]
    for var in [v for v in os.environ if v.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(n // m))
    cfg = get_preset(preset).replace(**overrides) if overrides else get_preset(preset)
    decided = plan_for(cfg, fake_caps(**{**CUDA_H100, "world_size": n}))["fsdp"].settings
    shipped = yaml.safe_load((FOLDER / f"{name}.yaml").read_text())
    assert launch_file_fsdp_config(decided) == shipped["fsdp_config"]
    hsdp = shipped.get("parallelism_config")
    assert decided.parallelism == (
        (hsdp["parallelism_config_dp_replicate_size"], hsdp["parallelism_config_dp_shard_size"]) if hsdp else None)


def test_multinode_yaml_marks_its_placeholders():
    text = (FOLDER / "fsdp2_hybrid_multinode.yaml").read_text()
    assert "main_process_ip: MAIN_NODE_IP  # REPLACE" in text
    assert "machine_rank: 0  # REPLACE on each node" in text
    assert "--machine_rank 1 --rdzv_conf timeout=300 examples/finetune.py --speedup fsdp" in text


def test_write_returns_text_or_path_and_loads(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    text = write_accelerate_config("fsdp", num_processes=4)
    assert "distributed_type: FSDP" in text and "num_processes: 4" in text
    path = write_accelerate_config("fsdp-offload", 4, 2, tmp_path / "x.yaml", main_process_ip="10.1.2.3")
    cfg = load_config_from_file(str(path))
    assert (cfg.num_processes, cfg.num_machines, cfg.main_process_ip) == (4, 2, "10.1.2.3")
    assert cfg.fsdp_config["fsdp_offload_params"] is True
    assert cfg.fsdp_config["fsdp_activation_checkpointing"] is True  # the preset checkpoints: FSDP does it, once
    assert cfg.dynamo_config == {}


def test_non_fsdp_presets_give_ddp_or_single_process():
    assert accelerate_config_dict("auto", 1)["distributed_type"] == "NO"
    assert accelerate_config_dict("lora", 4)["distributed_type"] == "MULTI_GPU"
    assert accelerate_config_dict("baseline", 4)["mixed_precision"] == "no"  # keeps the user's precision
    assert "dynamo_config" not in accelerate_config_dict("baseline", 4)


def test_no_shard_needs_fsdp1_through_accelerate():
    d = accelerate_config_dict(get_preset("fsdp").replace(fsdp={"strategy": "no_shard"}), 8)
    assert d["fsdp_config"]["fsdp_version"] == 1
    assert d["fsdp_config"]["fsdp_reshard_after_forward"] == "NO_SHARD"
    assert d["fsdp_config"]["fsdp_sharding_strategy"] == "NO_SHARD"
    assert d["fsdp_config"]["fsdp_use_orig_params"] is True


def test_bad_layout_is_one_error_listing_every_problem():
    with pytest.raises(SpeedupConfigError, match=r"2 problem\(s\)") as err:
        write_accelerate_config("fsdp", num_processes=0, num_machines=0)
    assert "num_processes = 0 is not allowed" in str(err.value)
    assert "num_machines = 0 is not allowed" in str(err.value)
    with pytest.raises(SpeedupConfigError, match=r"num_processes = 10 is not a multiple of num_machines = 3"):
        write_accelerate_config("fsdp", 10, 3)
    with pytest.raises(SpeedupConfigError, match=r"mixed_precision = 'fp8' is not allowed"):
        write_accelerate_config("fsdp", 8, mixed_precision="fp8")
    with pytest.raises(SpeedupConfigError, match=r"speedup = 'nope' is not a known preset"):
        write_accelerate_config("nope", 8)


def test_fsdp1_no_shard_file_gives_the_processes_no_shard(tmp_path, monkeypatch):
    """The launcher exports FSDP_SHARDING_STRATEGY (default FULL_SHARD), which accelerate's FSDP1 prefers over
    reshard_after_forward: the file must name the strategy there too."""
    import accelerate.utils.dataclasses as accelerate_dataclasses
    import torch
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import ShardingStrategy

    path = write_accelerate_config(get_preset("fsdp").replace(fsdp={"strategy": "no_shard"}), 8,
                                   path=tmp_path / "no_shard.yaml")
    for var in [v for v in os.environ if v.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))]:
        monkeypatch.delenv(var)
    _, env = _launch_env(path, monkeypatch)
    assert (env["FSDP_VERSION"], env["FSDP_SHARDING_STRATEGY"]) == ("1", "NO_SHARD")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # sync_module_states asks for a device id
    monkeypatch.setattr(accelerate_dataclasses, "is_cuda_available", lambda: True)
    plugin = FullyShardedDataParallelPlugin()  # from the env, as in a launched process
    assert (plugin.sharding_strategy or plugin.reshard_after_forward) == ShardingStrategy.NO_SHARD


# ------------------------------------------------------------------------------------------ what accelerate refuses
def test_the_multinode_file_passes_accelerates_own_check_on_the_gpus_it_claims_and_not_on_cpu(monkeypatch):
    """accelerate's Accelerator() validates the launch file's ParallelismConfig against its distributed type:
    FSDP2 on GPUs passes; CPU processes (MULTI_CPU, accelerate's FSDP off) are refused."""
    from types import SimpleNamespace

    from accelerate import ParallelismConfig
    from accelerate.utils import DistributedType

    for var in [v for v in os.environ if v.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))]:
        monkeypatch.delenv(var)
    _launch_env(FOLDER / "fsdp2_hybrid_multinode.yaml", monkeypatch)
    pc = ParallelismConfig()  # from the env, as Accelerator() builds it
    gpus = SimpleNamespace(num_processes=16, is_fsdp2=True, multi_device=False, is_main_process=True,
                           distributed_type=DistributedType.FSDP)
    pc._validate_accelerator(gpus)
    cpus = SimpleNamespace(**{**vars(gpus), "is_fsdp2": False, "distributed_type": DistributedType.MULTI_CPU})
    with pytest.raises(ValueError, match="ParallelismConfig is only compatible DistributedType.FSDP"):
        pc._validate_accelerator(cpus)


def _parallelism_env(monkeypatch, replicate: int, shard: int) -> None:
    for var in [v for v in os.environ if v.startswith(("ACCELERATE_", "FSDP_", "PARALLELISM_CONFIG_"))]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_REPLICATE_SIZE", str(replicate))
    monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", str(shard))


def test_a_parallelism_config_accelerate_refuses_is_said_when_the_plan_is_made(monkeypatch):
    _parallelism_env(monkeypatch, 2, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cpu4 = fake_caps(device_type="cpu", world_size=4)
    with pytest.raises(SpeedupConfigError, match=r"parallelism_config \(dp_replicate_size=2, dp_shard_size=2\) is "
                                                 r"refused by accelerate on CPU processes .* fix: speedup='fsdp'"):
        plan_for("auto", cpu4)
    # the fsdp preset applies that layout with its own FSDP2 on CPU
    assert plan_for("fsdp", cpu4)["fsdp"].settings.mesh.shape == (2, 2)
    # a layout that does not cover the processes: accelerate refuses it on any device
    _parallelism_env(monkeypatch, 2, 8)
    with pytest.raises(SpeedupConfigError, match=r"covers 16 processes but 4 run; accelerate refuses it .* "
                                                 r"parallelism_config_dp_shard_size: 2 "):
        plan_for("auto", fake_caps(**{**CUDA_H100, "world_size": 4}))


def test_speedup_trainer_says_so_before_accelerate_refuses(monkeypatch, tiny_model, make_args, dataset, collator):
    """One CPU process launched with a 2x2 parallelism_config: the stock Trainer stops inside Accelerator() with
    accelerate's ValueError; SpeedupTrainer refuses first, naming the config section and the fix."""
    from hf_speedup import SpeedupTrainer

    _parallelism_env(monkeypatch, 2, 2)
    with pytest.raises(SpeedupConfigError, match=r"covers 4 processes but 1 run; .* fix: set "
                                                 r"parallelism_config_dp_shard_size: 1 "):
        SpeedupTrainer(model=tiny_model, args=make_args(), train_dataset=dataset, data_collator=collator,
                       speedup="auto")


def test_the_context_parallel_file_plans_long_as_launched_on_eight_gpus(monkeypatch):
    """Launched with configs/accelerate/long_context_parallel.yaml on 8 GPUs: FSDP2 from the file, each row over 2
    ranks, SDPA attention, rows unpacked; the same launch without FSDP is refused with the fix."""
    from hf_speedup.tiny import tiny_llama

    _launch_env(FOLDER / "long_context_parallel.yaml", monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    caps = fake_caps(**{**CUDA_H100, "world_size": 8, "device_count": 8})
    plan = plan_for({"base": "long", "fsdp": {"enabled": True}}, caps, model=tiny_llama())
    sp = plan["sequence_parallel"]
    assert sp.applied == "context x2" and "each rank holds 1/2 of every row's tokens" in sp.reason
    assert plan["fsdp"].active and plan["attention"].applied == "sdpa"
    assert not plan["data"].settings.padding_free
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "false")
    with pytest.raises(SpeedupConfigError, match=r"context parallelism runs inside accelerate's FSDP2, and this plan has "
                                                 r"no FSDP2 .* fix: speedup=\{'base': 'long', 'fsdp': \{'enabled': True\}\}"):
        plan_for("long", caps, model=tiny_llama())


def test_context_parallel_needs_an_fsdp_preset_and_a_divisor():
    with pytest.raises(SpeedupConfigError, match=r"context_parallel = 3 is not allowed here; allowed: an integer >= 1 "
                                                 r"that divides num_processes, with a preset that shards with FSDP2"):
        accelerate_config_dict({"base": "long", "fsdp": {"enabled": True}}, 8, context_parallel=3)
    with pytest.raises(SpeedupConfigError, match=r"context_parallel = 2 is not allowed here"):
        accelerate_config_dict("long", 8, context_parallel=2)
