"""Attention at length: where the model's attention is eager (its memory quadratic in the length: a model without SDPA
support, or Gemma 2's logit softcapping, which SDPA cannot apply), the plan states the longest row that fits before
the run, warns where the known length does not fit, refuses under ``attention.strict``; and says nothing where no
length is known."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import pytest
import torch

from hf_speedup import estimate_memory, plan_for
from hf_speedup.config import SpeedupConfigError

from conftest import CPU_NO_BF16, fake_caps

CAPS = fake_caps(**CPU_NO_BF16, memory_bytes=256 << 20)


def _gemma2(softcap: float | None = 50.0):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=512, attn_logit_softcapping=softcap)
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config)


def _args(tmp_path, cls=None, **kw):
    from transformers import TrainingArguments

    return (cls or TrainingArguments)(output_dir=str(tmp_path / "out"), per_device_train_batch_size=1, use_cpu=True,
                                      report_to=[], **kw)


def _longest(reason: str) -> int:
    return int(re.search(r"the longest row that fits is ([0-9,]+) tokens", reason).group(1).replace(",", ""))


@pytest.mark.parametrize("softcap,why", [(50.0, "attn_logit_softcapping=50"), (None, "_supports_sdpa is False")])
def test_eager_attention_over_the_devices_memory_is_warned_with_the_longest_row_that_fits(tmp_path, caplog, softcap,
                                                                                          why):
    """Gemma 2 in transformers 5 has no SDPA support at all, and its logit softcapping would keep it off SDPA."""
    model = _gemma2(softcap)
    with caplog.at_level(logging.WARNING, logger="hf_speedup"):
        plan = plan_for({"memory": {"seq_len": 8192}}, CAPS, model, _args(tmp_path))
    entry = plan["attention"]
    assert entry.applied == "eager" and why in entry.reason
    assert "memory quadratic in the length; within 256.00 MiB (the memory of AMD EPYC (cpu))" in entry.reason
    assert "rows of 8,192 tokens (memory.seq_len) are predicted to need" in entry.reason
    assert "does NOT fit; fix: rows of at most" in entry.reason
    assert any("eager attention at length" in r.getMessage() for r in caplog.records)
    # the longest row is what the estimator itself says fits the device's memory, and one token more does not
    best = _longest(entry.reason)
    at = [estimate_memory(model, speedup={}, batch_size=1, seq_len=n, caps=CAPS).total_bytes for n in (best, best + 1)]
    assert at[0] <= 256 << 20 < at[1]


def test_under_strict_it_is_one_error_before_the_run(tmp_path):
    with pytest.raises(SpeedupConfigError, match=r"attention\.strict = true and the model's attention is 'eager' .*"
                                                 r"rows of 8,192 tokens \(memory\.seq_len\) are predicted to need .*"
                                                 r"allowed: rows of at most [0-9,]+ tokens with this plan and memory; "
                                                 r"fix: rows of at most .*attention\.strict: false"):
        plan_for({"memory": {"seq_len": 8192}, "attention": {"strict": True}}, CAPS, _gemma2(), _args(tmp_path))


def test_a_row_that_fits_is_said_without_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hf_speedup"):
        plan = plan_for({"memory": {"seq_len": 512}, "attention": {"strict": True}}, CAPS, _gemma2(), _args(tmp_path))
    assert "rows of 512 tokens (memory.seq_len) are predicted to need" in plan["attention"].reason
    assert plan["attention"].reason.endswith(": fits")
    assert not any("attention at length" in r.getMessage() for r in caplog.records)


def test_the_budget_and_the_arguments_max_length_are_named(tmp_path):
    from transformers import TrainingArguments

    @dataclass
    class WithMaxLength(TrainingArguments):  # TRL's SFTConfig carries max_length
        max_length: int = 4096

    plan = plan_for({"memory": {"budget": "1GiB"}}, CAPS, _gemma2(), _args(tmp_path, WithMaxLength))
    reason = plan["attention"].reason
    assert "within 1.00 GiB (memory.budget: 1GiB)" in reason
    assert "rows of 4,096 tokens (the arguments' max_length)" in reason
    device = plan_for({"memory": {"seq_len": 4096}}, CAPS, _gemma2(), _args(tmp_path))["attention"].reason
    assert "(the memory of AMD EPYC (cpu))" in device and _longest(reason) > _longest(device)  # 1 GiB > 256 MiB


def test_nothing_is_said_without_a_known_length_or_for_a_kernel_linear_in_the_length(tmp_path):
    unknown = plan_for({}, CAPS, _gemma2(), _args(tmp_path))["attention"]
    assert unknown.applied == "eager" and "at length" not in unknown.reason
    from hf_speedup.tiny import tiny_llama

    sdpa = plan_for({"memory": {"seq_len": 8192}}, CAPS, tiny_llama(), _args(tmp_path))["attention"]
    assert sdpa.applied == "sdpa" and "at length" not in sdpa.reason
