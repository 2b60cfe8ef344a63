"""SpeedupConfig validation: every problem at once, each naming field, value, allowed values and fix."""

import pytest

from hf_speedup import SpeedupConfig, SpeedupConfigError
from hf_speedup.presets import load_config, resolve


def test_defaults_are_valid():
    assert SpeedupConfig().problems() == []


def test_one_error_lists_every_problem():
    with pytest.raises(SpeedupConfigError) as info:
        SpeedupConfig.from_dict({
            "compile": {"mode": "fastest", "backend": "tvm"},
            "optimizer": {"name": "adam"},
            "checkpointing": {"every_n_blocks": 0},
        })
    err = info.value
    assert len(err.problems) == 4
    text = str(err)
    assert "compile.mode = 'fastest' is not allowed; allowed: None, 'default', 'reduce-overhead'" in text
    assert "compile.backend = 'tvm'" in text
    assert "optimizer.name = 'adam' is not allowed; allowed: 'auto', 'keep', 'adamw', 'adamw_fused'" in text
    assert "checkpointing.every_n_blocks = 0 is not allowed; allowed: an integer >= 1; fix:" in text


@pytest.mark.parametrize(
    "data, match",
    [
        ({"compile": {"enabeld": True}}, r"compile\.enabeld is not a known setting.*did you mean 'compile\.enabled'"),
        ({"optimiser": {}}, r"optimiser is not a known setting.*did you mean 'optimizer'"),
        ({"precision": {"dtype": "float16"}}, r"precision\.dtype = 'float16' is not allowed; allowed: 'auto', 'keep', 'bf16', 'fp16', 'fp32'; fix: set precision\.dtype: 'auto'"),
        ({"lora": {"quantization": "4bit"}}, r"lora\.quantization = '4bit' needs lora\.enabled = true"),
        ({"lora": {"enabled": True, "target_modules": []}}, r"lora\.target_modules = \[\] is not allowed"),
        ({"lora": {"enabled": True, "dropout": 1.5}}, r"lora\.dropout = 1\.5 is not allowed; allowed: a number in \[0, 1\)"),
        ({"fsdp": {"version": True}}, r"fsdp\.version = True is not allowed; allowed: 1, 2"),
        ({"memory": {"empty_cache_steps": -5}}, r"memory\.empty_cache_steps = -5 is not allowed; allowed: null or an integer >= 1"),
        ({"data": {"num_workers": "two"}}, r"data\.num_workers = 'two' is not allowed; allowed: null or an integer >= 0"),
        ({"fsdp": {"enabled": "yes"}}, r"fsdp\.enabled = 'yes' is not allowed; allowed: true, false"),
        ({"compile": 3}, r"compile = 3 is not a mapping"),
    ],
)
def test_each_problem_is_named(data, match):
    with pytest.raises(SpeedupConfigError, match=match):
        SpeedupConfig.from_dict(data)


def test_direct_construction_is_validated_when_resolved():
    cfg = SpeedupConfig()
    cfg.compile.mode = "turbo"
    with pytest.raises(SpeedupConfigError, match=r"compile\.mode = 'turbo'"):
        resolve(cfg)


def test_yaml_round_trip(tmp_path):
    cfg = SpeedupConfig.from_dict({"name": "mine", "compile": {"enabled": True, "mode": "max-autotune"},
                                   "lora": {"enabled": True, "target_modules": ["q_proj", "v_proj"]}})
    path = tmp_path / "mine.yaml"
    cfg.to_yaml(path)
    assert load_config(path) == cfg


def test_replace_updates_one_section_and_validates():
    cfg = SpeedupConfig().replace(compile={"enabled": True})
    assert cfg.compile.enabled is True and cfg.compile.backend == "inductor"
    with pytest.raises(SpeedupConfigError, match=r"compile\.backend = 'nope'"):
        SpeedupConfig().replace(compile={"backend": "nope"})
