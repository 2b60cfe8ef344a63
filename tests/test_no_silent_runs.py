"""No silently wrong runs: each case below once trained something other than what was asked, without a word.

Every test reads the live objects (what trains, what the loader drops, which precision runs, which blocks
are compiled) and what the report says about it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback

from conftest import CPU_NO_BF16, CUDA_H100, fake_caps
from hf_speedup import SpeedupTrainer, plan_for, training_arguments
from hf_speedup.blocks import block_class_names, find_blocks
from hf_speedup.features import data
from hf_speedup.model_info import describe_model
from hf_speedup.presets import resolve
from hf_speedup.tiny import tiny_llama

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def small_llama(seed: int = 0):
    return tiny_llama(seed=seed, **SMALL)


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=128,
                                      bos_token_id=1, eos_token_id=2, pad_token_id=0))


def tiny_bert():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    return BertForMaskedLM(BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                      intermediate_size=64, vocab_size=64, max_position_embeddings=128))


def trainable(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


# ------------------------------------------------------------------------------------- config base
def test_a_dict_configs_base_is_merged_and_trains_adapters(make_args, dataset, collator):
    cfg = resolve({"base": "lora", "lora": {"r": 8}})
    assert (cfg.lora.enabled, cfg.lora.r, cfg.name) == (True, 8, "lora+custom")
    trainer = SpeedupTrainer(model=small_llama(), args=make_args(max_steps=1), train_dataset=dataset,
                             data_collator=collator, speedup={"base": "lora", "lora": {"r": 8}})
    names = trainable(trainer.model)
    assert names and all("lora_" in n for n in names)
    assert trainer.model.peft_config["default"].r == 8


# ------------------------------------------------------------------------------------- model_init
def test_model_init_models_get_the_plan_at_construction_and_at_every_train(make_args, dataset, collator):
    from peft import PeftModel

    made = []

    def model_init():
        made.append(small_llama())
        return made[-1]

    trainer = SpeedupTrainer(model_init=model_init, args=make_args(max_steps=2), train_dataset=dataset,
                             data_collator=collator, speedup="lora")
    assert len(made) == 1 and isinstance(trainer.model, PeftModel)  # the first model planned for, then adapted
    assert trainer.speedup_status["lora"].engaged is True
    trainer.train()  # the Trainer calls model_init again: a fresh model, adapted the same way
    assert len(made) == 2 and isinstance(trainer.model, PeftModel)
    assert trainer.model.get_base_model() is made[1]
    # as Trainer.__init__ does for its first model: no KV cache in training forwards (compiled blocks would
    # recompile for it, and padding-free rows would attend across sequences)
    assert made[1].config.use_cache is trainer.args.use_cache is False
    names = trainable(trainer.model)
    assert names and all("lora_" in n for n in names)
    assert trainer.speedup_status["lora"].engaged is True  # verified again on the model that trained
    assert trainer.speedup_report.to_dict()["plan"]["lora"]["engaged"] is True


def test_model_init_with_a_trial_argument_and_the_trainers_seed(make_args, dataset, collator):
    from transformers import LlamaForCausalLM, Trainer

    from hf_speedup.tiny import tiny_llama_config

    trials = []

    def model_init(trial):  # unseeded: the weights come from the seed the Trainer sets before calling it
        trials.append(trial)
        return LlamaForCausalLM(tiny_llama_config(**SMALL))

    args = make_args(max_steps=1, seed=7)
    ours = SpeedupTrainer(model_init=model_init, args=args, train_dataset=dataset, data_collator=collator,
                          speedup="baseline")
    stock = Trainer(model_init=model_init, args=args, train_dataset=dataset, data_collator=collator)
    assert trials == [None, None]
    for (n, a), b in zip(ours.model.named_parameters(), stock.model.parameters()):
        assert torch.equal(a, b), n


# ------------------------------------------------------------------------------------- GPT-2 Conv1D
def test_gpt2_conv1d_projections_are_lora_targets(make_args, dataset, collator):
    model = tiny_gpt2()
    assert describe_model(model).linear_names == ("c_attn", "c_proj", "c_fc")
    trainer = SpeedupTrainer(model=model, args=make_args(max_steps=2), train_dataset=dataset, data_collator=collator,
                             speedup="lora")
    state = trainer.speedup_status["lora"]
    assert state.engaged is True, state.engaged_reason
    from hf_speedup.features.lora import lora_layers

    layers = lora_layers(trainer.model)
    assert {type(m.get_base_layer()).__name__ for m in layers.values()} == {"Conv1D"}
    assert len(layers) == 2 * 4  # c_attn, attn.c_proj, c_fc, mlp.c_proj in each of 2 blocks
    assert trainer.model.peft_config["default"].fan_in_fan_out is True
    trainer.train()
    assert all("lora_" in n for n in trainable(trainer.model))


def test_gpt2_explicit_conv1d_target_is_accepted(make_args, dataset, collator):
    trainer = SpeedupTrainer(model=tiny_gpt2(), args=make_args(max_steps=1), train_dataset=dataset,
                             data_collator=collator, speedup={"base": "lora", "lora": {"target_modules": ["c_attn"]}})
    from hf_speedup.features.lora import lora_layers

    assert sorted(n.split(".")[-1] for n in lora_layers(trainer.model)) == ["c_attn", "c_attn"]
    assert trainer.speedup_status["lora"].engaged is True


# ------------------------------------------------------------------------------------- BERT blocks
def test_bert_embeddings_are_not_a_repeated_block():
    bert = tiny_bert()
    assert block_class_names(bert) == ["BertLayer"]
    assert find_blocks(bert) == list(bert.bert.encoder.layer)
    plan = plan_for("memory", caps=fake_caps(**CPU_NO_BF16), model=bert)
    assert plan.model.block_class == "BertLayer" and plan.model.num_blocks == 2


@pytest.mark.parametrize("order", [["BertEmbeddings", "BertLayer"], ["BertLayer", "BertEmbeddings"]])
def test_block_label_does_not_depend_on_the_order_of_no_split_modules(order):
    # transformers keeps _no_split_modules in a set: its order changes from one interpreter run to the next
    bert = tiny_bert()
    for m in bert.modules():
        if getattr(m, "_no_split_modules", None):
            m._no_split_modules = list(order)
    assert describe_model(bert).block_class == "BertLayer"


# ------------------------------------------------------------------------------------- drop_last
def _fast_no_compile():
    """fast on padded rows: the case drop_last is for (static shapes)."""
    return {"base": "fast", "compile": {"enabled": False}, "data": {"padding_free": False}}


def test_padding_free_rows_drop_nothing_and_say_why(make_args, dataset, collator):
    trainer = SpeedupTrainer(model=small_llama(), args=make_args(max_steps=1), train_dataset=dataset,
                             data_collator=collator, speedup={"base": "fast", "compile": {"enabled": False}})
    state = trainer.speedup_status["data"]
    assert state.settings.padding_free and trainer.args.dataloader_drop_last is False
    assert "drop_last not applied: padding-free rows" in state.reason and "drop_last" not in state.applied


def test_fewer_rows_than_one_batch_keeps_the_partial_batch_and_says_so(make_args, dataset, collator):
    rows = dataset.select(range(3))
    trainer = SpeedupTrainer(model=small_llama(), args=make_args(max_steps=-1, num_train_epochs=1,
                                                                 per_device_train_batch_size=4),
                             train_dataset=rows, data_collator=collator, speedup=_fast_no_compile())
    assert trainer.args.dataloader_drop_last is False
    state = trainer.speedup_status["data"]
    assert any(re.search(r"drop_last=True: the training set has 3 row\(s\), fewer than one batch \(4 per device x 1 "
                         r"process\(es\)\).*the last partial batch is kept", f) for f in state.fallbacks), state.fallbacks
    assert "drop_last" not in state.applied
    out = trainer.train()
    assert out.global_step == 1 and out.training_loss > 0  # one real step, not zero steps reported as success


class _Rows(torch.utils.data.IterableDataset):
    def __init__(self, rows):
        self.rows = rows

    def __iter__(self):
        return iter(self.rows)


def test_iterable_dataset_does_not_claim_drop_last(make_args, dataset, collator):
    stream = _Rows([dataset[i] for i in range(10)])
    trainer = SpeedupTrainer(model=small_llama(), args=make_args(max_steps=2), train_dataset=stream,
                             data_collator=collator, speedup=_fast_no_compile())
    state = trainer.speedup_status["data"]
    assert trainer.args.dataloader_drop_last is False
    assert any("the training set is an IterableDataset" in f for f in state.fallbacks), state.fallbacks
    assert "args.dataloader_drop_last" not in state.engaged_reason
    assert "not applied: " in state.engaged_reason and "IterableDataset" in state.engaged_reason


def test_explicit_drop_last_false_from_training_arguments_is_kept(tmp_path, dataset, collator):
    args = training_arguments("baseline", output_dir=str(tmp_path / "o"), use_cpu=True, max_steps=1, report_to=[],
                              per_device_train_batch_size=4, dataloader_drop_last=False, save_strategy="no")
    trainer = SpeedupTrainer(model=small_llama(), args=args, train_dataset=dataset, data_collator=collator,
                             speedup=_fast_no_compile())
    assert trainer.args.dataloader_drop_last is False
    state = trainer.speedup_status["data"]
    assert ("drop_last: kept your TrainingArguments.dataloader_drop_last=False over the config's drop_last=True"
            in state.reason)


def test_the_presets_drop_last_never_reaches_the_arguments_evaluation_reads(make_args, dataset, collator):
    trainer = SpeedupTrainer(model=small_llama(), args=make_args(max_steps=1, dataloader_drop_last=False),
                             train_dataset=dataset, data_collator=collator, speedup=_fast_no_compile())
    assert trainer.args.dataloader_drop_last is False  # the evaluation and prediction loaders read this one
    assert trainer.speedup_status["data"].reason.count("drop each epoch's last partial training batch") == 1


def test_explicit_pin_memory_false_wins_over_the_preset_on_cuda(make_args):
    # differs from the default: an explicit choice (use_cpu would turn pinning off itself, whoever asked)
    args = make_args(dataloader_pin_memory=False, use_cpu=False)
    d = plan_for("auto", caps=fake_caps(**CUDA_H100), args=args)["data"]
    assert "dataloader_pin_memory" not in data.training_args(d, args)
    assert "pin_memory: kept your TrainingArguments.dataloader_pin_memory=False" in d.reason


# ------------------------------------------------------------------------------------- stock presets
def test_training_arguments_says_what_it_drops(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="hf_speedup"):
        args = training_arguments("fast", output_dir=str(tmp_path), use_cpu=True)
    assert args.torch_compile is False and args.dataloader_drop_last is False
    assert ("preset 'fast': compile=True changes the model itself and cannot be expressed in TrainingArguments: "
            "dropped here; use SpeedupTrainer") in caplog.text
    assert ("preset 'fast': data.drop_last (the last partial training batch) cannot be expressed in "
            "TrainingArguments, whose dataloader_drop_last drops evaluation and prediction rows too: dropped here"
            ) in caplog.text
    assert "data.padding_free (padding-free rows) replaces the collator and cannot be expressed" in caplog.text
    assert set(getattr(args, data.EXPLICIT_ARGS_ATTR)) == {"output_dir", "use_cpu"}


# ------------------------------------------------------------------------------------- launcher precision
@pytest.fixture
def amx_cpu(monkeypatch):
    import hf_speedup.hardware as hardware

    monkeypatch.setattr(hardware, "_cpu_bf16", lambda: (True, "faked for the test: CPU has AMX tiles"))


def test_launcher_mixed_precision_no_wins_over_auto_bf16(amx_cpu, monkeypatch, make_args, dataset, collator):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")  # accelerate launch --mixed_precision no
    trainer = SpeedupTrainer(model=small_llama(), args=make_args(max_steps=1), train_dataset=dataset,
                             data_collator=collator, speedup="auto")
    state = trainer.speedup_status["precision"]
    assert state.applied == "fp32"
    assert state.reason.startswith("auto keeps the launcher's mixed_precision=no (ACCELERATE_MIXED_PRECISION) over "
                                   "auto's own choice here (bf16)")
    trainer.train()
    assert trainer.accelerator.mixed_precision == "no"
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert "fp32 (no mixed precision) in force as planned" in trainer.speedup_status["precision"].engaged_reason


def test_without_a_launcher_choice_auto_picks_bf16_on_amx(amx_cpu, monkeypatch, make_args, dataset, collator):
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    trainer = SpeedupTrainer(model=small_llama(), args=make_args(max_steps=1), train_dataset=dataset,
                             data_collator=collator, speedup="auto")
    assert trainer.speedup_status["precision"].applied == "bf16"
    assert trainer.accelerator.mixed_precision == "bf16"


def test_launcher_bf16_is_kept_by_auto_and_by_baseline(monkeypatch, make_args):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    args = make_args()  # TrainingArguments read the variable too: mixed_precision='bf16'
    assert args.mixed_precision == "bf16"
    auto = plan_for("auto", caps=fake_caps(**CPU_NO_BF16), args=args)["precision"]
    assert auto.applied == "bf16" and "auto keeps the launcher's mixed_precision=bf16" in auto.reason
    base = plan_for("baseline", caps=fake_caps(**CPU_NO_BF16), args=args)["precision"]
    assert base.applied == "bf16"  # what the stock Trainer runs under that launcher: verify expects it


# ------------------------------------------------------------------------------------- plan table
def _start_table(text: str, features) -> dict[str, str]:
    """feature -> engaged column of the plan table printed when training starts."""
    out = {}
    for line in text.split("hf_speedup metrics:")[0].splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if len(cells) >= 4 and cells[0] in features and cells[-1] in ("yes", "no", "?"):
            out[cells[0]] = cells[-1]
    return out


@pytest.mark.parametrize("preset", ["auto", "fast", "memory", "lora"])
def test_plan_table_at_start_agrees_with_the_final_report(preset, make_args, dataset, collator, capsys):
    cfg = resolve(preset)
    if cfg.compile.enabled is True:
        cfg = cfg.replace(compile={"backend": "eager", "mode": None})
    trainer = SpeedupTrainer(model=small_llama(), args=make_args(max_steps=2), train_dataset=dataset,
                             data_collator=collator, speedup=cfg)
    trainer.train()
    final = trainer.speedup_report.to_dict()["plan"]
    start = _start_table(capsys.readouterr().out, final)
    assert start and set(start) <= set(final)
    assert start == {f: ("yes" if final[f]["engaged"] else "no") for f in start}


# ------------------------------------------------------------------------------------- reporting never kills
class _BreakOutputDir(TrainerCallback):
    """Turns output_dir into a file once training has started: nothing can be written there any more."""

    def on_train_begin(self, args, state, control, **kwargs):
        shutil.rmtree(args.output_dir, ignore_errors=True)
        Path(args.output_dir).write_text("not a directory")


def _tmp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def test_an_unwritable_output_dir_after_start_does_not_end_the_run(make_args, dataset, collator, tmp_path, caplog):
    args = make_args(output_dir=str(tmp_path / "run"), max_steps=2)
    trainer = SpeedupTrainer(model=small_llama(), args=args, train_dataset=dataset, data_collator=collator,
                             speedup="auto", callbacks=[_BreakOutputDir()])
    with caplog.at_level(logging.WARNING, logger="hf_speedup"):
        out = trainer.train()
    assert out.global_step == 2
    assert "could not write" in caplog.text and "training goes on" in caplog.text
    assert trainer.speedup_report.to_dict()["metrics"]["tokens_per_second"]  # kept in memory
    assert _tmp_files(tmp_path) == []


class _ReadOnlyOutputDir(TrainerCallback):
    def on_train_begin(self, args, state, control, **kwargs):
        os.chmod(args.output_dir, 0o555)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes through file modes")
def test_a_read_only_output_dir_after_start_does_not_end_the_run(make_args, dataset, collator, tmp_path, caplog):
    run = tmp_path / "run"
    run.mkdir()
    trainer = SpeedupTrainer(model=small_llama(), args=make_args(output_dir=str(run), max_steps=2),
                             train_dataset=dataset, data_collator=collator, speedup="auto",
                             callbacks=[_ReadOnlyOutputDir()])
    try:
        with caplog.at_level(logging.WARNING, logger="hf_speedup"):
            assert trainer.train().global_step == 2
    finally:
        os.chmod(run, 0o755)
    assert "could not write" in caplog.text and _tmp_files(tmp_path) == []


def test_a_full_disk_leaves_no_partial_report(make_args, dataset, collator, tmp_path, monkeypatch, caplog):
    real = Path.write_text

    def disk_full(self, text, *a, **kw):
        if self.name.endswith(".tmp"):
            real(self, text[: len(text) // 2], *a, **kw)  # half written, then the disk is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(self, text, *a, **kw)

    monkeypatch.setattr(Path, "write_text", disk_full)
    trainer = SpeedupTrainer(model=small_llama(), args=make_args(output_dir=str(tmp_path / "run"), max_steps=2),
                             train_dataset=dataset, data_collator=collator, speedup="auto")
    with caplog.at_level(logging.WARNING, logger="hf_speedup"):
        assert trainer.train().global_step == 2
    assert "No space left on device" in caplog.text
    assert _tmp_files(tmp_path) == [] and not (tmp_path / "run" / "speedup_report.json").exists()


def test_a_failure_inside_the_collector_does_not_end_the_run(make_args, dataset, collator, monkeypatch, caplog):
    from hf_speedup.report import measure

    def broken(*a, **kw):
        raise RuntimeError("memory probe broke")

    monkeypatch.setattr(measure, "memory_snapshot", broken)
    trainer = SpeedupTrainer(model=small_llama(), args=make_args(max_steps=3), train_dataset=dataset,
                             data_collator=collator, speedup="auto")
    with caplog.at_level(logging.WARNING, logger="hf_speedup"):
        out = trainer.train()
    assert out.global_step == 3 and out.training_loss > 0
    assert "reporting failed in" in caplog.text and "memory probe broke" in caplog.text
    assert "hf_speedup/tokens_per_second" not in json.dumps(trainer.state.log_history[-1])


# ------------------------------------------------------------------------------------- LoRA, plain nn.Module
class _PlainLM(torch.nn.Module):
    """Not a transformers model: its own forward returns the loss."""

    def __init__(self, vocab: int = 64, width: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.proj = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        logits = self.head(torch.relu(self.proj(self.embed(input_ids))))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits}


def test_lora_on_a_plain_module_uses_peft_generic_model_and_trains(make_args, dataset, collator):
    from peft import PeftModel, PeftModelForCausalLM

    trainer = SpeedupTrainer(model=_PlainLM(), args=make_args(max_steps=2), train_dataset=dataset,
                             data_collator=collator, speedup={"base": "lora", "lora": {"target_modules": ["proj"]}})
    assert isinstance(trainer.model, PeftModel) and not isinstance(trainer.model, PeftModelForCausalLM)
    state = trainer.speedup_status["lora"]
    assert state.engaged is True, state.engaged_reason
    assert "_PlainLM is not a transformers causal LM: adapters added through peft's generic PeftModel" in state.reason
    assert trainer.train().global_step == 2
    assert sorted(trainable(trainer.model)) == ["base_model.model.proj.lora_A.default.weight",
                                                "base_model.model.proj.lora_B.default.weight"]
