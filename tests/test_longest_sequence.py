"""The estimator answers the longest sequence a preset trains in a budget (``longest_sequence``, ``hf-speedup estimate
--max-seq-len``), with the bytes per token and the bytes at 0 tokens; the report states the per-token figure the plan
expected."""

from __future__ import annotations

import pytest

from hf_speedup import estimate_memory, longest_sequence
from hf_speedup.config import SpeedupConfigError
from hf_speedup.tiny import tiny_llama_config

from conftest import CPU_NO_BF16, CUDA_H100, fake_caps

CPU = fake_caps(**CPU_NO_BF16, memory_bytes=16 << 30)


@pytest.mark.parametrize("preset,attention,step", [("memory", "sdpa", 64), ("auto", "eager", 1), ("lora", "sdpa", 8)])
def test_the_answer_fits_the_budget_and_one_step_more_does_not(preset, attention, step):
    """Searched on the estimate itself (eager attention keeps heads x length per token: not linear in the length)."""
    config = tiny_llama_config()
    config._attn_implementation = attention
    found = longest_sequence(config, speedup=preset, budget="2GiB", step=step, caps=CPU)
    assert found.seq_len % step == 0 and found.budget_bytes == 2 << 30
    at = estimate_memory(config, speedup=preset, batch_size=1, seq_len=found.seq_len, caps=CPU)
    over = estimate_memory(config, speedup=preset, batch_size=1, seq_len=found.seq_len + step, caps=CPU)
    assert at.total_bytes == found.estimate.total_bytes <= 2 << 30 < over.total_bytes == found.over.total_bytes
    # the slope and the constant come from two lengths: the answer and half of it
    half = estimate_memory(config, speedup=preset, batch_size=1, seq_len=found.seq_len // 2, caps=CPU)
    assert found.constant_bytes + found.bytes_per_token * found.seq_len == pytest.approx(at.total_bytes)
    assert found.constant_bytes + found.bytes_per_token * (found.seq_len // 2) == pytest.approx(half.total_bytes)


def test_a_bigger_batch_or_a_leaner_preset_moves_the_answer_the_right_way():
    config = tiny_llama_config()
    one = longest_sequence(config, speedup="auto", budget="1GiB", caps=CPU)
    four = longest_sequence(config, speedup="auto", budget="1GiB", batch_size=4, caps=CPU)
    lean = longest_sequence(config, speedup="memory", budget="1GiB", caps=CPU)
    assert four.seq_len < one.seq_len < lean.seq_len
    # per token of the micro-batch: four rows grow by four tokens per token of length, each costing about the same
    assert four.bytes_per_token == pytest.approx(one.bytes_per_token, rel=0.1)


def test_nothing_fits_is_an_answer_not_an_error():
    found = longest_sequence(tiny_llama_config(), speedup="auto", budget=1000, caps=CPU)
    assert found.seq_len is None and found.budget_bytes == 1000 and "already need" in found.notes[0]


def test_auto_is_the_devices_memory():
    h100 = fake_caps(**CUDA_H100, memory_bytes=80 << 30)
    found = longest_sequence(tiny_llama_config(), speedup="memory", budget="auto", step=1024, caps=h100)
    assert found.budget_bytes == 80 << 30 and found.estimate.total_bytes <= 80 << 30


@pytest.mark.parametrize("budget", ["20 gigs", "-1GB", None, True])
def test_a_bad_budget_is_one_error_naming_the_field_before_any_model_work(budget, monkeypatch):
    from hf_speedup import estimate

    monkeypatch.setattr(estimate, "describe_for_estimate", lambda *a, **k: pytest.fail("described a model"))
    with pytest.raises(SpeedupConfigError, match=rf"budget = {budget!r} is not a memory size.*allowed: bytes as an "
                                                 r"integer, a size such as '20GiB'.*; fix: e\.g\. budget='20GiB'"):
        longest_sequence(tiny_llama_config(), speedup="memory", budget=budget, caps=CPU)


def test_bad_sizes_are_one_error():
    with pytest.raises(SpeedupConfigError, match=r"step = 0.*allowed: integers >= 1"):
        longest_sequence(tiny_llama_config(), budget="1GiB", step=0, caps=CPU)


def test_cli_max_seq_len_prints_the_answer_the_slope_and_the_constant(capsys, monkeypatch):
    from hf_speedup import hardware
    from hf_speedup.cli import main

    monkeypatch.setattr(hardware, "_cpu_bf16", lambda: (False, "faked for the test: CPU without AMX"))
    rc = main(["estimate", "--tiny", "--preset", "memory", "--max-seq-len", "--budget", "1GiB", "--step", "128",
               "--json"])
    import json

    found = json.loads(capsys.readouterr().out)
    assert rc == 0 and found["seq_len"] % 128 == 0 and found["budget_bytes"] == 1 << 30
    assert found["estimate"]["total_bytes"] <= 1 << 30 < found["over"]["total_bytes"]
    assert main(["estimate", "--tiny", "--preset", "memory", "--max-seq-len", "--budget", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert f"longest row: {found['seq_len']:,}" not in out  # step 1 answers a finer length than step 128
    assert "longest row: " in out and " at 0 tokens (the slope between rows of " in out


@pytest.mark.parametrize("argv,message", [
    (["--max-seq-len", "--budget", "lots"], "hf-speedup estimate: error: --budget = 'lots' is not a memory size"),
    (["--max-seq-len", "--budget", "1GiB", "--seq-len", "64"], "estimate --max-seq-len answers the length: drop "
                                                                "--seq-len"),
    ([], "estimate: --seq-len is missing; fix: --seq-len 2048"),
])
def test_cli_max_seq_len_mistakes_are_one_line(capsys, argv, message):
    from hf_speedup.cli import main

    assert main(["estimate", "--tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_the_report_states_the_per_token_figure_the_plan_expected(tiny_model, dataset, collator, make_args):
    from hf_speedup import SpeedupTrainer
    from hf_speedup.report.console import metrics_table

    trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=2), train_dataset=dataset,
                             data_collator=collator, speedup="memory")
    trainer.train()
    report = trainer.speedup_report.to_dict()
    est = report["measurement"]["memory_estimate"]
    rows, seq = est["micro_batch"], est["seq_len"]
    at = [estimate_memory(tiny_model, speedup="memory", batch_size=rows, seq_len=n, padded=est["padded"]).total_bytes
          for n in (seq // 2, seq)]
    expected = (at[1] - at[0]) / (seq - seq // 2) / rows
    assert est["bytes"] == at[1], (est, at)
    assert est["bytes_per_token"] == pytest.approx(expected, abs=0.1) and expected > 0
    assert est["constant_bytes"] == pytest.approx(at[1] - expected * rows * seq, abs=2)
    text = metrics_table(report, width=200)
    assert "expected per token" in text and "what the plan expects each token of the micro-batch to add" in text


def test_block_inputs_offloaded_to_the_host_leave_the_device_and_the_answer_grows():
    """``long`` on CUDA keeps every checkpointed block's input in host memory, one prefetched back in backward: the
    device holds two block inputs (the block recomputing and the next) where it held all of them."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                  tie_word_embeddings=False)
    h100 = fake_caps(**CUDA_H100, memory_bytes=80 << 30)
    long_lora = {"base": "long", "lora": {"enabled": True}}
    on = longest_sequence(config, speedup=long_lora, budget="auto", step=1024, caps=h100)
    off = longest_sequence(config, speedup={**long_lora, "checkpointing": {"offload": False}}, budget="auto",
                           step=1024, caps=h100)
    assert on.estimate.setup.offload_inputs and not off.estimate.setup.offload_inputs
    assert on.seq_len > off.seq_len
    # at the top block's backward: the inputs of the 31 blocks below it, against the one prefetched (bf16, 4096 wide)
    assert off.bytes_per_token - on.bytes_per_token == pytest.approx(30 * 4096 * 2, rel=0.02)
