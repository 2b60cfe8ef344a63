"""data: padding to a multiple on the real collator, and the DataLoader settings in the trainer's args."""

from __future__ import annotations

import pytest

from conftest import CPU_NO_BF16, CUDA_H100, fake_caps
from hf_speedup import SpeedupTrainer, get_preset
from hf_speedup.plan import plan_for as make_plan
from hf_speedup.compat import replace_args
from hf_speedup.features import data
from hf_speedup.plan_types import Outcome


def plan_for(caps: dict, args=None, **data_settings):
    cfg = get_preset("baseline").replace(data=data_settings)
    return make_plan(cfg, caps=fake_caps(**caps), args=args)["data"]


@pytest.fixture(scope="module")
def varlen_dataset(tokenizer):
    """Unpacked rows: lengths vary, so padding decides the batch length."""
    from hf_speedup.tiny import make_dataset

    return make_dataset(tokenizer, n=64, seed=1)


# ------------------------------------------------------------------------------------------ plan
def test_baseline_changes_nothing(make_args):
    d = make_plan("baseline", caps=fake_caps(**CUDA_H100), args=make_args())["data"]
    assert d.applied == "off" and data.training_args(d, make_args()) == {}


def test_loader_settings_on_cuda_map_to_trainingarguments(make_args):
    d = plan_for(CUDA_H100, num_workers=4, pin_memory=True, prefetch_factor=4, persistent_workers=True,
                 pad_to_multiple_of=8)
    assert d.fallbacks == ()
    assert data.training_args(d, make_args()) == {
        "dataloader_num_workers": 4, "dataloader_pin_memory": True, "dataloader_prefetch_factor": 4,
        "dataloader_persistent_workers": True}
    assert replace_args(make_args(), data.training_args(d, make_args())).dataloader_prefetch_factor == 4


def test_pinning_is_not_applied_on_cpu(make_args):
    d = plan_for(CPU_NO_BF16, pin_memory=True)
    # the arguments stay the user's (the stock Trainer's warning included): nothing to gain from changing them
    assert "dataloader_pin_memory" not in data.training_args(d, make_args())
    assert d.fallbacks and d.fallbacks[0].startswith("pin_memory: pinned host memory only speeds host-to-GPU")


def test_prefetch_and_persistent_workers_need_workers(make_args):
    d = plan_for(CUDA_H100, args=make_args(dataloader_num_workers=0), prefetch_factor=4, persistent_workers=True)
    assert data.training_args(d, None) == {}
    assert [f.split("=")[0] for f in d.fallbacks] == ["prefetch_factor", "persistent_workers"]
    # the user's workers count: with workers in the args, prefetch is valid
    d = plan_for(CUDA_H100, args=make_args(dataloader_num_workers=2), prefetch_factor=4)
    assert data.training_args(d, None) == {"dataloader_prefetch_factor": 4}


def test_zero_workers_clears_worker_only_settings_from_the_args_so_they_stay_valid(make_args):
    args = make_args(dataloader_num_workers=2, dataloader_prefetch_factor=2, dataloader_persistent_workers=True)
    d = plan_for(CPU_NO_BF16, args=args, num_workers=0)
    new = replace_args(args, data.training_args(d, args))  # TrainingArguments validation would raise otherwise
    assert (new.dataloader_num_workers, new.dataloader_prefetch_factor, new.dataloader_persistent_workers) == (0, None, False)


# ------------------------------------------------------------------------------------------ collator
def test_padding_collator_is_copied_not_mutated(collator):
    new, note = data.padded_collator(collator, None, 8)
    assert new is not collator and new.pad_to_multiple_of == 8 and collator.pad_to_multiple_of is None
    assert "pad_to_multiple_of=8" in note


def test_collator_already_padding_to_a_multiple_is_kept(tokenizer):
    from hf_speedup.tiny import causal_lm_collator

    c64 = causal_lm_collator(tokenizer, pad_to_multiple_of=64)
    assert data.padded_collator(c64, None, 8)[0] is c64
    c12 = causal_lm_collator(tokenizer, pad_to_multiple_of=12)
    assert data.padded_collator(c12, None, 8)[0].pad_to_multiple_of == 8  # 12 is not a multiple of 8


def test_default_collator_is_rebuilt_only_where_the_trainer_would_pad(tokenizer):
    from transformers import DataCollatorWithPadding

    built, _ = data.padded_collator(None, tokenizer, 8)
    assert type(built) is DataCollatorWithPadding and built.pad_to_multiple_of == 8
    none, why = data.padded_collator(None, None, 8)
    assert none is None and "default_data_collator" in why
    fn, why = data.padded_collator(lambda rows: rows, tokenizer, 8)
    assert fn is None and "has no pad_to_multiple_of" in why


# ------------------------------------------------------------------------------------------ real objects
def _lengths(trainer, n=6):
    out = []
    for i, batch in enumerate(trainer.get_train_dataloader()):
        out.append(batch["input_ids"].shape[1])
        if i + 1 == n:
            break
    return out


def test_real_batches_are_padded_to_the_multiple(varlen_dataset, collator, make_args):
    from hf_speedup.tiny import tiny_llama

    def trainer(cfg):
        return SpeedupTrainer(model=tiny_llama(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                               num_key_value_heads=2),
                              args=make_args(max_steps=2), train_dataset=varlen_dataset, data_collator=collator,
                              speedup=cfg)

    plain = _lengths(trainer("baseline"))
    assert any(n % 8 for n in plain), plain  # otherwise this test could not tell padding apart
    padded_trainer = trainer(get_preset("baseline").replace(data={"pad_to_multiple_of": 8}))
    assert padded_trainer.data_collator is not collator and collator.pad_to_multiple_of is None
    assert all(n % 8 == 0 for n in _lengths(padded_trainer))
    padded_trainer.train()
    d = padded_trainer.speedup_status["data"]
    assert d.engaged is True and "DataCollatorForLanguageModeling.pad_to_multiple_of=8" in d.engaged_reason


def test_tokenizer_only_gets_the_trainers_default_collator_with_padding(tiny_model, varlen_dataset, tokenizer,
                                                                       make_args):
    from transformers import DataCollatorWithPadding

    cfg = get_preset("baseline").replace(data={"pad_to_multiple_of": 16})
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(), train_dataset=varlen_dataset,
                             processing_class=tokenizer, speedup=cfg)
    assert type(trainer.data_collator) is DataCollatorWithPadding and trainer.data_collator.pad_to_multiple_of == 16
    assert all(n % 16 == 0 for n in _lengths(trainer, 3))
    assert trainer.speedup_status["data"].engaged is True


def test_no_collator_and_no_tokenizer_is_reported_not_engaged(tiny_model, make_args):
    from datasets import Dataset

    rows = Dataset.from_dict({"input_ids": [[5] * 12] * 8, "attention_mask": [[1] * 12] * 8})  # stackable as they are
    cfg = get_preset("baseline").replace(data={"pad_to_multiple_of": 8})
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(), train_dataset=rows, speedup=cfg)
    d = trainer.speedup_status["data"]
    assert d.engaged is False and d.applied == "off"
    assert "no collator to pad" in d.fallbacks[0] and "no collator to pad" in d.engaged_reason


def test_loader_settings_are_in_the_trainers_args(tiny_model, dataset, collator, make_args):
    cfg = get_preset("baseline").replace(data={"num_workers": 1, "prefetch_factor": 3, "persistent_workers": True})
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(), train_dataset=dataset, data_collator=collator,
                             speedup=cfg)
    a = trainer.args
    assert (a.dataloader_num_workers, a.dataloader_prefetch_factor, a.dataloader_persistent_workers) == (1, 3, True)
    d = trainer.speedup_status["data"]
    assert d.engaged is True and "args.dataloader_prefetch_factor=3" in d.engaged_reason
    trainer.args.dataloader_prefetch_factor = 2  # verify reads the live args, not the plan
    engaged, reason = data.verify(trainer.speedup_plan["data"], trainer, trainer.speedup_outcomes["data"])
    assert engaged is False and "MISMATCH: planned 3" in reason


def test_drop_last_removes_the_odd_sized_last_batch(tokenizer, collator, make_args):
    from hf_speedup.tiny import make_dataset, tiny_llama

    rows = make_dataset(tokenizer, n=20, seed=2).select(range(10))  # 10 rows, batch 4: 4 + 4 + 2

    def batch_sizes(cfg):
        t = SpeedupTrainer(model=tiny_llama(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                            num_key_value_heads=2),
                           args=make_args(per_device_train_batch_size=4), train_dataset=rows,
                           data_collator=collator, speedup=cfg)
        return t, [b["input_ids"].shape[0] for b in t.get_train_dataloader()]

    assert batch_sizes("baseline")[1] == [4, 4, 2]
    trainer, sizes = batch_sizes(get_preset("baseline").replace(data={"drop_last": True}))
    # the training loader drops it; the arguments, which the evaluation and prediction loaders read, do not
    assert sizes == [4, 4] and trainer.args.dataloader_drop_last is False
    assert [b["input_ids"].shape[0] for b in trainer.get_eval_dataloader(rows)] == [8, 2]
    d = trainer.speedup_status["data"]
    assert d.applied == "train_drop_last" and d.reason.startswith("drop each epoch's last partial training batch")
    trainer.callback_handler.train_dataloader = trainer.get_train_dataloader()  # as train() registers it
    assert data.verify(trainer.speedup_plan["data"], trainer, trainer.speedup_outcomes["data"]) == (
        True, "training loader drop_last=True; args.dataloader_drop_last=False for evaluation and prediction")


def test_fast_preset_drops_only_the_last_training_batch_and_only_under_static_shape_compile(make_args):
    fast = make_plan("fast", caps=fake_caps(**CPU_NO_BF16), args=make_args())["data"]
    assert fast.settings.train_drop_last and "dataloader_drop_last" not in data.training_args(fast, None)
    base = make_plan("baseline", caps=fake_caps(**CPU_NO_BF16), args=make_args(dataloader_drop_last=True))["data"]
    assert not base.settings.train_drop_last and "dataloader_drop_last" not in data.training_args(base, None)
    # fast without its compile (no toolchain here, say): the preset's drop_last is withdrawn, with the reason
    plan = make_plan("fast", caps=fake_caps(**{**CPU_NO_BF16, "compile": False}), args=make_args())
    outcome = Outcome()
    assert data.train_drop_last(plan, outcome) is False
    assert outcome.fallbacks == ["drop_last=True: nothing compiles with static shapes in this run (compile is off), "
                                 "so a partial last batch costs no recompile; the last partial batch is kept"]


# ------------------------------------------------------------------------------------------ TRL arguments
def _small_llama():
    from hf_speedup.tiny import tiny_llama

    return tiny_llama(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


def test_dpo_config_is_not_asked_for_padding_free_its_trainer_switches_off(tmp_path):
    """TRL's DPOTrainer turns DPOConfig.padding_free off: the plan must not count on it (nor drop the padding
    multiple and drop_last for it); it says why, and what does apply is verified on the live trainer."""
    import copy

    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from hf_speedup import SpeedupMixin
    from hf_speedup.tiny import chat_tokenizer

    class MyDPO(SpeedupMixin, trl.DPOTrainer):
        pass

    rows = Dataset.from_list([{"prompt": f"{i}+{i}=", "chosen": str(2 * i), "rejected": str(2 * i + 1)}
                              for i in range(32)])
    args = trl.DPOConfig(output_dir=str(tmp_path / "dpo"), per_device_train_batch_size=8, max_steps=1, report_to=[],
                         use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, max_length=None)
    model = _small_llama()
    trainer = MyDPO(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=rows,
                    processing_class=chat_tokenizer(), speedup=get_preset("fast").replace(compile={"backend": "eager"}))
    d = trainer.speedup_status["data"]
    assert not d.settings.padding_free and d.settings.padding_free_via is None
    assert "DPOConfig.padding_free is not honoured by its trainer" in d.reason
    assert trainer.args.padding_free is False and trainer.padding_free is False
    assert trainer.data_collator.pad_to_multiple_of == 64 and trainer.args.dataloader_drop_last is False
    assert d.engaged is True, d.engaged_reason
    assert trainer.model.config._attn_implementation != "sdpa_varlen"  # nothing packed to keep apart
    explicit = make_plan(get_preset("baseline").replace(data={"padding_free": True}), caps=fake_caps(**CPU_NO_BF16),
                          model=model, args=args)["data"]
    assert not explicit.settings.padding_free
    assert explicit.fallbacks[0].startswith("padding_free: DPOConfig.padding_free is not honoured by its trainer")


def test_packing_without_padding_free_keeps_the_last_batch(tmp_path):
    """SFTConfig.packing=True: TRL packs the 48 examples into a few rows, fewer than one batch; drop_last
    would leave no batch at all, so the plan does not set it and says why."""
    trl = pytest.importorskip("trl")
    from hf_speedup import SpeedupSFTTrainer
    from hf_speedup.tiny import chat_dataset, chat_tokenizer

    args = trl.SFTConfig(output_dir=str(tmp_path / "p"), per_device_train_batch_size=8, num_train_epochs=1,
                         report_to=[], use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True,
                         max_length=512, packing=True)
    trainer = SpeedupSFTTrainer(model=_small_llama(), args=args, train_dataset=chat_dataset(48, seed=0),
                                processing_class=chat_tokenizer(),
                                speedup={"base": "fast", "compile": {"enabled": False},
                                         "data": {"padding_free": False}})
    assert len(trainer.train_dataset) < 8  # fewer packed rows than one batch: the case drop_last empties
    assert trainer.args.dataloader_drop_last is False and len(trainer.get_train_dataloader()) == 1
    d = trainer.speedup_status["data"]
    assert "drop_last not applied: SFTConfig.packing=True packs several examples per row" in d.reason
    # the plan's own packing counts the same way
    plain = trl.SFTConfig(output_dir=str(tmp_path / "q"), use_cpu=True, bf16=False, max_length=512)
    cfg = get_preset("fast").replace(data={"padding_free": False, "packing": True})
    assert "dataloader_drop_last" not in data.training_args(
        make_plan(cfg, caps=fake_caps(**CPU_NO_BF16), args=plain)["data"], plain)


def test_a_question_answering_head_keeps_its_rows_as_padded_as_the_stock_trainer(tokenizer, make_args, monkeypatch):
    """transformers' QA loss is a softmax over every position of the row, padding included: rounding rows up to a
    multiple (auto: 8, fast: 64) changed the first loss from 2.40 to 2.78 / 4.17 on a tiny RoBERTa. The presets
    leave the collator's padding alone there (reported), and the losses equal the stock Trainer's (both in fp32:
    on a CPU where auto picks bf16 the losses would differ by precision alone)."""
    import torch
    import transformers as T
    from datasets import Dataset

    import hf_speedup.hardware as hardware

    monkeypatch.setattr(hardware, "_cpu_bf16", lambda: (False, "faked for the test: fp32 on every CPU"))

    rows = [{"input_ids": list(range(4, 4 + n)), "start_positions": 1, "end_positions": 3} for n in (7, 9, 10, 11)]

    def first_loss(cls, **kw):
        torch.manual_seed(0)
        model = T.RobertaForQuestionAnswering(T.RobertaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64,
            max_position_embeddings=80, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        trainer = cls(model=model, args=make_args(max_steps=1, per_device_train_batch_size=4, logging_steps=1),
                      train_dataset=Dataset.from_list(rows), data_collator=T.DataCollatorWithPadding(tokenizer), **kw)
        trainer.train()
        return trainer, trainer.state.log_history[0]["loss"]

    _, stock = first_loss(T.Trainer)
    for preset in ("auto", "fast"):
        trainer, loss = first_loss(SpeedupTrainer, speedup=preset)
        assert loss == pytest.approx(stock, rel=1e-5), preset
        assert trainer.data_collator.pad_to_multiple_of is None
        assert "not applied: the loss of a question-answering head (RobertaForQuestionAnswering) runs over every " \
               "position" in trainer.speedup_plan["data"].reason
