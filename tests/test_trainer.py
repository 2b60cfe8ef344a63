"""SpeedupTrainer end to end: stock behaviour kept, baseline == stock Trainer, presets keep the math."""

import json

import pytest
import torch
from transformers import Trainer, TrainerCallback

from hf_speedup import SpeedupConfigError, SpeedupTrainer, get_preset, list_presets
from hf_speedup.tiny import tiny_llama

from conftest import SAME_DTYPE_LOSS_REL, assert_same_in_dtype

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
REPORT_FEATURES = {"precision", "compile", "optimizer", "checkpointing", "empty_cache", "lora", "fsdp"}


def _losses(trainer):
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_baseline_matches_stock_trainer_step_for_step(make_args, dataset, collator, tmp_path):
    stock = Trainer(model=tiny_llama(seed=0, **SMALL), args=make_args(output_dir=str(tmp_path / "a"), max_steps=6),
                    train_dataset=dataset, data_collator=collator)
    stock.train()
    ours = SpeedupTrainer(model=tiny_llama(seed=0, **SMALL), args=make_args(output_dir=str(tmp_path / "b"), max_steps=6),
                          train_dataset=dataset, data_collator=collator, speedup="baseline")
    ours.train()
    assert len(_losses(stock)) == 6
    assert _losses(ours) == _losses(stock)  # exactly: baseline changes nothing
    assert type(ours.optimizer.optimizer) is type(stock.optimizer.optimizer)


class _FirstStep(TrainerCallback):
    """Grabs the first step's gradients (before the optimizer moves anything)."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
        if self.grads is None:
            self.grads = {n.replace("base_model.model.", ""): p.grad.detach().clone()
                          for n, p in model.named_parameters() if p.grad is not None}


def _first_step(preset, make_args, dataset, collator, tmp_path):
    grab = _FirstStep()
    cfg = get_preset(preset) if isinstance(preset, str) else preset
    trainer = SpeedupTrainer(model=tiny_llama(seed=0, **SMALL),
                             args=make_args(output_dir=str(tmp_path / cfg.name), max_steps=1),
                             train_dataset=dataset, data_collator=collator, speedup=cfg, callbacks=[grab])
    trainer.train()
    return trainer, _losses(trainer)[0], grab.grads


def _compile_light(cfg):
    """Same preset with the aot_eager backend: the wiring (regions, shapes) without inductor's cold start."""
    return cfg.replace(compile={"backend": "aot_eager", "mode": None}) if cfg.compile.enabled is True else cfg


def _same_precision_reference(trainer, cfg, cpu_kind):
    """The dtype the preset ran in, checked on the live Trainer, and ``baseline`` pinned to that dtype.

    Like with like: a preset's math is compared with the stock loop in the same precision, so the test
    holds on a CPU with AMX (``auto`` -> bf16) and without (fp32) alike.
    """
    dtype = "bf16" if cpu_kind == "cpu-amx" and cfg.precision.dtype == "auto" else "fp32"
    assert trainer.accelerator.mixed_precision == ("bf16" if dtype == "bf16" else "no"), trainer.speedup_status["precision"]
    return dtype, get_preset("baseline").replace(precision={"dtype": dtype})


def _assert_same_first_step(dtype, loss, grads, base_loss, base_grads, lora: bool):
    assert loss == pytest.approx(base_loss, rel=SAME_DTYPE_LOSS_REL[dtype])
    if not lora:  # full fine-tune: every gradient matches the reference's
        assert grads.keys() == base_grads.keys()
        for name, g in grads.items():
            assert_same_in_dtype(g, base_grads[name], dtype, name)
    else:  # adapters only: base weights get no gradient at all
        assert grads and all("lora_" in n for n in grads)


@pytest.mark.parametrize("preset", sorted(set(list_presets()) - {"baseline"}))
def test_every_preset_trains_and_keeps_first_step_math(preset, cpu_kind, make_args, dataset, collator, tmp_path):
    cfg = _compile_light(get_preset(preset))
    if cfg.fsdp.enabled:
        pytest.skip("FSDP presets need several processes: tests/test_fsdp*.py")
    trainer, loss, grads = _first_step(cfg, make_args, dataset, collator, tmp_path)
    dtype, reference = _same_precision_reference(trainer, cfg, cpu_kind)
    _, base_loss, base_grads = _first_step(reference, make_args, dataset, collator, tmp_path)
    _assert_same_first_step(dtype, loss, grads, base_loss, base_grads, lora=cfg.lora.enabled)
    report = json.loads((trainer.args.output_dir and open(f"{trainer.args.output_dir}/speedup_report.json").read()))
    assert REPORT_FEATURES <= set(report["plan"])
    for entry in report["plan"].values():
        assert isinstance(entry["engaged"], bool) and entry["reason"]


@pytest.mark.slow
def test_fast_preset_with_inductor_keeps_first_step_math(cpu_kind, make_args, dataset, collator, tmp_path):
    fast = get_preset("fast").replace(compile={"when": "always"})  # a one-step run would never earn a compile back
    trainer, loss, grads = _first_step(fast, make_args, dataset, collator, tmp_path)
    assert trainer.speedup_status["compile"].engaged, trainer.speedup_status["compile"].engaged_reason
    dtype, reference = _same_precision_reference(trainer, get_preset("fast"), cpu_kind)
    _, base_loss, base_grads = _first_step(reference, make_args, dataset, collator, tmp_path)
    _assert_same_first_step(dtype, loss, grads, base_loss, base_grads, lora=False)


class _Untouchable:
    def __getattr__(self, name):
        raise AssertionError(f"model touched ({name}) before the config was validated")


def test_bad_config_fails_before_any_model_work(make_args):
    with pytest.raises(SpeedupConfigError, match=r"compile\.mode = 'ludicrous'.*\n.*optimizer\.name = 'sgd'"):
        SpeedupTrainer(model=_Untouchable(), args=make_args(),
                       speedup={"compile": {"mode": "ludicrous"}, "optimizer": {"name": "sgd"}})


class _Recorder(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_evaluate(self, args, state, control, **kw):
        self.events.append("evaluate")

    def on_save(self, args, state, control, **kw):
        self.events.append("save")

    def on_step_end(self, args, state, control, **kw):
        self.events.append(state.global_step)


def test_stock_features_keep_working(make_args, dataset, collator, tmp_path):
    """eval, save, resume and user callbacks behave as with the stock Trainer."""
    rec = _Recorder()
    args = make_args(output_dir=str(tmp_path / "run"), max_steps=4, eval_strategy="steps", eval_steps=2,
                     save_strategy="steps", save_steps=2, per_device_eval_batch_size=4)
    split = dataset.train_test_split(test_size=16, seed=0)
    trainer = SpeedupTrainer(model=tiny_llama(seed=0, **SMALL), args=args, train_dataset=split["train"],
                             eval_dataset=split["test"], data_collator=collator, callbacks=[rec], speedup="auto")
    trainer.train()
    assert rec.events.count("evaluate") == 2 and rec.events.count("save") == 2
    assert (tmp_path / "run" / "checkpoint-2").is_dir() and (tmp_path / "run" / "checkpoint-4").is_dir()
    assert "eval_loss" in trainer.evaluate()

    args2 = make_args(output_dir=str(tmp_path / "run"), max_steps=6, save_strategy="no")
    steps = _Recorder()
    resumed = SpeedupTrainer(model=tiny_llama(seed=0, **SMALL), args=args2, train_dataset=split["train"],
                             data_collator=collator, speedup="auto", callbacks=[steps])
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-4"))
    assert steps.events == [5, 6]  # resumed at step 4, not restarted


def test_user_training_arguments_are_not_mutated(make_args, dataset, collator):
    args = make_args(optim="adamw_torch")
    before = args.to_dict()
    SpeedupTrainer(model=tiny_llama(seed=0, **SMALL), args=args, train_dataset=dataset, data_collator=collator,
                   speedup="fast")
    assert args.to_dict() == before


def test_speedup_accepts_name_config_and_yaml(make_args, dataset, collator, tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("base: baseline\noptimizer:\n  name: adamw_fused\n")
    for speedup, name in (("baseline", "baseline"), (get_preset("lora"), "lora"), (str(path), "mine")):
        t = SpeedupTrainer(model=tiny_llama(seed=0, **SMALL), args=make_args(), train_dataset=dataset,
                           data_collator=collator, speedup=speedup)
        assert t.speedup_plan.config.name == name
