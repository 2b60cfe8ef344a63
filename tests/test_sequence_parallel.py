"""Sequence parallelism as the plan meets it (fake GPUs: the split itself runs only on several CUDA devices): a
context-parallel layout planned with FSDP2, SDPA and unpacked rows; every combination that cannot run refused up
front with its fix; ``sequence_parallel.enabled: false`` leaves it unplanned."""

from __future__ import annotations

import pytest
from conftest import CPU_NO_BF16, CUDA_H100, fake_caps

from hf_speedup import SpeedupConfigError, plan_for
from hf_speedup.tiny import tiny_llama

GPUS4 = {**CUDA_H100, "world_size": 4, "device_count": 4}


@pytest.fixture
def launch(monkeypatch):
    """A process of a 4-GPU ``accelerate launch`` whose config has a parallelism_config of these sizes."""
    def launched(cp=1, sp=1):
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
        monkeypatch.setenv("PARALLELISM_CONFIG_DP_SHARD_SIZE", str(4 // (cp * sp)))
        monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", str(cp))
        monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", str(sp))
    return launched


def _args(cp=1, sp=1):
    """TrainingArguments with accelerate's ParallelismConfig of these sizes (as a user passes it)."""
    from accelerate import ParallelismConfig
    from transformers import TrainingArguments

    pc = ParallelismConfig(cp_size=cp, sp_size=sp) if cp > 1 or sp > 1 else None
    return TrainingArguments(output_dir="unused", report_to=[], per_device_train_batch_size=1, parallelism_config=pc)


def test_context_parallel_is_planned_with_fsdp2_sdpa_and_unpacked_rows(launch):
    launch(cp=2)
    plan = plan_for({"base": "long", "fsdp": {"enabled": True}}, fake_caps(**GPUS4), model=tiny_llama())
    sp = plan["sequence_parallel"]
    assert sp.applied == "context x2" and sp.settings.degree == 2
    assert "the accelerate launch config's parallelism_config" in sp.reason
    assert "not run on GPUs by hf_speedup yet" in sp.reason
    assert plan["attention"].applied == "sdpa"
    assert not plan["data"].settings.padding_free


def test_off_without_a_split_and_when_left_to_accelerate(launch):
    assert plan_for("long", fake_caps(**CPU_NO_BF16), model=tiny_llama(), args=_args())["sequence_parallel"].applied \
        == "off"
    launch(cp=2)
    plan = plan_for({"base": "long", "sequence_parallel": {"enabled": False}}, fake_caps(**GPUS4), model=tiny_llama())
    assert plan["sequence_parallel"].applied == "off" and "unplanned and unchecked" in plan["sequence_parallel"].reason


def test_context_parallel_without_fsdp2_is_refused_with_the_fix(launch):
    launch(cp=2)
    with pytest.raises(SpeedupConfigError, match=r"cp_size=2, sp_size=1: context parallelism runs inside accelerate's "
                                                 r"FSDP2, and this plan has no FSDP2 .*fix: speedup=\{'base': 'long', "
                                                 r"'fsdp': \{'enabled': True\}\}"):
        plan_for("long", fake_caps(**GPUS4), model=tiny_llama())


def test_every_problem_of_a_layout_in_one_error():
    """From the TrainingArguments' own ParallelismConfig, on one CPU process."""
    cfg = {"base": "long", "attention": {"implementation": "eager"}, "data": {"padding_free": True}}
    with pytest.raises(SpeedupConfigError) as err:
        plan_for(cfg, fake_caps(**CPU_NO_BF16), model=tiny_llama(), args=_args(cp=2))
    text = str(err.value)
    for expected in ("TrainingArguments.parallelism_config asks for cp_size=2",
                     "on cpu processes: sequence parallelism runs on CUDA GPUs", "this plan has no FSDP2",
                     "attention.implementation = 'eager' cannot run under", "data.padding_free = true cannot run under"):
        assert expected in text, (expected, text)


def test_both_at_once_and_ulysses_without_deepspeed_are_refused(launch):
    launch(cp=2, sp=2)
    with pytest.raises(SpeedupConfigError) as err:
        plan_for({"base": "long", "fsdp": {"enabled": True}}, fake_caps(**GPUS4), model=tiny_llama())
    assert "one of them at a time" in str(err.value)
    assert "Ulysses (sp_backend deepspeed) needs a DeepSpeed engine" in str(err.value)


def test_ulysses_needs_heads_that_divide(launch, monkeypatch):
    import hf_speedup.features.sequence_parallel as seq

    monkeypatch.setattr(seq, "zero_stage", lambda ctx: 3)  # as under a DeepSpeed config
    model = tiny_llama(num_attention_heads=4, num_key_value_heads=2)
    launch(sp=2)
    ok = plan_for("long", fake_caps(**GPUS4), model=model)["sequence_parallel"]
    assert ok.applied == "ulysses x2" and "1/2 of the attention heads" in ok.reason
    launch(sp=4)
    six_heads = tiny_llama(hidden_size=192, num_attention_heads=6, num_key_value_heads=2)
    with pytest.raises(SpeedupConfigError, match=r"has 6 query and 2 key/value heads; allowed: sp_size dividing 6 .* "
                                                 r"fix: parallelism_config_sp_size: 2"):
        plan_for("long", fake_caps(**GPUS4), model=six_heads)
