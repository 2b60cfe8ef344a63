"""Presets: names, YAML files in configs/presets, inheritance, TrainingArguments presets."""

from pathlib import Path

import pytest

from hf_speedup import SpeedupConfigError, get_preset, list_presets, training_arguments
from hf_speedup.presets import load_config, resolve

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "presets"
REQUIRED = {"baseline", "auto", "fast", "memory", "lora", "qlora"}


def test_required_presets_exist_with_descriptions():
    presets = list_presets()
    assert REQUIRED <= set(presets)
    for name, desc in presets.items():
        assert "trade-off" in desc.lower() or name in ("baseline", "auto"), name


@pytest.mark.parametrize("name", sorted(list_presets()))
def test_shipped_yaml_equals_python_preset(name):
    path = CONFIGS / f"{name}.yaml"
    assert path.is_file(), f"configs/presets/{name}.yaml missing: run `hf-speedup presets --write configs/presets`"
    assert load_config(path) == get_preset(name)


def test_every_shipped_yaml_is_a_known_preset():
    assert {p.stem for p in CONFIGS.glob("*.yaml")} == set(list_presets())


def test_unknown_preset_names_the_allowed_ones():
    with pytest.raises(SpeedupConfigError, match=r"speedup = 'fastest' is not a known preset; allowed: baseline, auto, fast"):
        resolve("fastest")


def test_yaml_inherits_from_base_preset(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("base: fast\ncompile:\n  backend: aot_eager\n")
    cfg = load_config(path)
    assert cfg.compile.backend == "aot_eager"
    assert cfg.compile.mode == get_preset("fast").compile.mode  # the rest of the section is inherited
    assert cfg.name == "mine"


def test_bad_yaml_reports_every_problem(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("compile:\n  mode: warp\noptimizer:\n  name: sgd\n")
    with pytest.raises(SpeedupConfigError, match=r"2 problem\(s\)"):
        load_config(path)


def test_missing_yaml_path():
    with pytest.raises(SpeedupConfigError, match=r"no such file"):
        resolve("does/not/exist.yaml")


def test_training_arguments_is_stock_and_keeps_user_values(tmp_path):
    from transformers import TrainingArguments

    args = training_arguments("auto", output_dir=str(tmp_path), learning_rate=3e-4, use_cpu=True)
    assert type(args) is TrainingArguments
    assert args.learning_rate == 3e-4 and args.output_dir == str(tmp_path)


def test_training_arguments_baseline_changes_nothing(tmp_path):
    from transformers import TrainingArguments

    kw = dict(output_dir=str(tmp_path), use_cpu=True, optim="adamw_torch", bf16=False)
    got, stock = training_arguments("baseline", **kw), TrainingArguments(**kw)
    assert got.to_dict() == stock.to_dict()


def test_training_arguments_carries_what_args_can_express(tmp_path, caplog):
    args = training_arguments("memory", output_dir=str(tmp_path), use_cpu=True)
    assert args.optim != "paged_adamw_8bit"  # no CUDA here: the fallback, not the request
    with caplog.at_level("WARNING", logger="hf_speedup"):
        training_arguments("lora", output_dir=str(tmp_path), use_cpu=True)
    assert "lora=" in caplog.text and "use SpeedupTrainer" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_speedup"):
        training_arguments("baseline", output_dir=str(tmp_path), use_cpu=True)
    assert "cannot be expressed" not in caplog.text


def test_training_arguments_expresses_checkpointing_for_the_stock_trainer(tmp_path):
    from hf_speedup.compat import checkpointing_arg_names

    flag, kwargs_name = checkpointing_arg_names()
    args = training_arguments("memory", output_dir=str(tmp_path), use_cpu=True)
    assert getattr(args, flag) is True
    assert getattr(args, kwargs_name)["use_reentrant"] is False
