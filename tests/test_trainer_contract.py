"""The stock Trainer's contract under every preset: evaluation and prediction see every row, a resumed run's
``trainer_state.json`` is the uninterrupted one's, ``baseline`` leaves ``output_dir``, the callback list and the
logs as the stock Trainer does, and what the user sets in TrainingArguments wins."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_speedup import SpeedupTrainer, training_arguments
from hf_speedup.callback_handler import all_callbacks
from hf_speedup.blocks import find_blocks
from hf_speedup.compat import unwrap_optimizer
from hf_speedup.features.checkpointing.mechanism import block_checkpoint_fn
from hf_speedup.report.schema import PREFIX
from hf_speedup.tiny import make_dataset, tiny_llama

# Single-process presets; the precision is pinned, so every preset computes what the stock Trainer computes on
# any CPU (AMX or not) and only the rows and batches can differ.
PRESETS = ["baseline", "auto", "fast", "memory", "lora", "qlora"]


def _config(preset: str) -> dict:
    return {"base": preset, "precision": {"dtype": "fp32"}}


def _model():
    return tiny_llama(seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2)


ARGS = dict(per_device_train_batch_size=4, per_device_eval_batch_size=8, max_steps=2, logging_steps=1, report_to=[],
            use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True, dataloader_num_workers=0)


def _args(out: Path, **kw) -> TrainingArguments:
    return TrainingArguments(**{**ARGS, "output_dir": str(out), **kw})


@pytest.fixture(scope="module")
def rows(tokenizer):
    """66 rows of different lengths: not a multiple of the evaluation batch (8), padding in every batch."""
    return make_dataset(tokenizer, n=66, seed=1)


def _rows_seen(eval_pred) -> dict:
    labels = torch.as_tensor(eval_pred.label_ids)
    logits = torch.as_tensor(eval_pred.predictions)
    mask = labels[:, 1:] != -100
    hits = (logits[:, :-1].argmax(-1) == labels[:, 1:]) & mask
    return {"rows": labels.shape[0], "tokens": int(mask.sum()), "accuracy": float(hits.sum() / mask.sum())}


def _stock_predictions(rows, collator, out: Path):
    stock = Trainer(model=_model(), args=_args(out), train_dataset=rows, eval_dataset=rows, data_collator=collator,
                    compute_metrics=_rows_seen)
    return stock.evaluate(), stock.predict(rows)


@pytest.mark.parametrize("preset", PRESETS)
def test_evaluate_and_predict_see_every_row_as_the_stock_trainer(preset, rows, collator, tmp_path):
    stock_metrics, stock_pred = _stock_predictions(rows, collator, tmp_path / "stock")
    assert stock_metrics["eval_rows"] == 66 and stock_pred.predictions.shape[0] == 66
    trainer = SpeedupTrainer(model=_model(), args=_args(tmp_path / preset), train_dataset=rows, eval_dataset=rows,
                             data_collator=collator, compute_metrics=_rows_seen, speedup=_config(preset))
    metrics, pred = trainer.evaluate(), trainer.predict(rows)
    assert metrics["eval_rows"] == 66 and metrics["eval_tokens"] == stock_metrics["eval_tokens"]
    assert metrics["eval_accuracy"] == pytest.approx(stock_metrics["eval_accuracy"], abs=1e-6)
    assert metrics["eval_loss"] == pytest.approx(stock_metrics["eval_loss"], rel=1e-5)
    # the same arrays: every row, padded as the user's collator pads (not flattened, not padded further)
    assert pred.predictions.shape == stock_pred.predictions.shape
    assert (pred.label_ids == stock_pred.label_ids).all()
    torch.testing.assert_close(torch.as_tensor(pred.predictions), torch.as_tensor(stock_pred.predictions),
                               rtol=1e-4, atol=1e-4)
    assert trainer.args.dataloader_drop_last is False


def test_fast_drops_only_the_last_training_batch_and_evaluation_during_training_sees_every_row(
        rows, collator, tmp_path):
    """Under static-shape compile (here with dynamo's eager backend) the training loader drops its last partial
    batch; an evaluation in the middle of training still sees all 66 rows."""
    seen = []

    class Rows(TrainerCallback):
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            seen.append(metrics["eval_rows"])

    cfg = {**_config("fast"), "compile": {"backend": "eager", "when": "always"}, "data": {"padding_free": False}}
    trainer = SpeedupTrainer(model=_model(), args=_args(tmp_path, max_steps=-1, num_train_epochs=1, eval_strategy="steps",
                                                        eval_steps=8, per_device_train_batch_size=8),
                             train_dataset=rows, eval_dataset=rows, data_collator=collator,
                             compute_metrics=_rows_seen, speedup=cfg, callbacks=[Rows()])
    trainer.train()
    assert trainer.state.global_step == 66 // 8  # 8 full batches; the 2 rows left over are the dropped partial
    assert seen == [66] and trainer.args.dataloader_drop_last is False
    assert trainer.speedup_status["data"].engaged, trainer.speedup_status["data"].engaged_reason


# ----------------------------------------------------------------------------------------- resume
class StopAt(TrainerCallback):
    """Kills the run (an exception, as a crash would) when ``step`` begins."""

    def __init__(self, step: int):
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt(f"stopped at step {self.step}")


def _state(path: Path) -> dict:
    """``trainer_state.json`` without what the stock Trainer itself varies between runs: the wall-clock figures
    of its evaluation logs (``eval_runtime``, ``eval_*_per_second``)."""
    state = json.loads((path / "trainer_state.json").read_text())
    state["log_history"] = [{k: v for k, v in entry.items() if not k.endswith(("_runtime", "_per_second"))}
                            for entry in state["log_history"]]
    return state


def _run(preset, rows, collator, out: Path, stop: int | None = None, resume: bool = False):
    trainer_cls, kw = (Trainer, {}) if preset == "stock" else (SpeedupTrainer, {"speedup": _config(preset)})
    trainer = trainer_cls(model=_model(), args=_args(out, max_steps=6, save_strategy="steps", save_steps=3,
                                                     eval_strategy="steps", eval_steps=3),
                          train_dataset=rows, eval_dataset=rows.select(range(10)), data_collator=collator,
                          callbacks=[StopAt(stop)] if stop else None, **kw)
    if stop:
        with pytest.raises(KeyboardInterrupt):
            trainer.train()
        return trainer
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer


@pytest.mark.parametrize("preset", ["stock", "baseline", "auto", "fast", "lora"])
def test_a_resumed_run_writes_the_uninterrupted_runs_trainer_state(preset, rows, collator, tmp_path):
    whole = _run(preset, rows, collator, tmp_path / "whole")
    _run(preset, rows, collator, tmp_path / "cut", stop=4)
    assert sorted(p.name for p in (tmp_path / "cut").glob("checkpoint-*")) == ["checkpoint-3"]
    resumed = _run(preset, rows, collator, tmp_path / "cut", resume=True)
    assert _state(tmp_path / "cut" / "checkpoint-6") == _state(tmp_path / "whole" / "checkpoint-6")
    # the logs are the stock Trainer's keys: our measurements go to the report and the trackers only
    assert not any(k.startswith(PREFIX) for entry in whole.state.log_history + resumed.state.log_history
                   for k in entry)


# ----------------------------------------------------------------------------------------- baseline
def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_baseline_leaves_output_dir_callbacks_and_logs_as_the_stock_trainer(rows, collator, tmp_path, capsys):
    runs = {}
    for name, cls, kw in (("stock", Trainer, {}), ("baseline", SpeedupTrainer, {"speedup": "baseline"})):
        capsys.readouterr()
        trainer = cls(model=_model(), args=_args(tmp_path / name, max_steps=4, save_strategy="steps", save_steps=2,
                                                 save_total_limit=1, report_to=["tensorboard"]),
                      train_dataset=rows, data_collator=collator, **kw)
        callbacks = [type(cb) for cb in trainer.callback_handler.callbacks]
        trainer.train()
        runs[name] = (trainer, callbacks, capsys.readouterr().out)
    (stock, stock_callbacks, stock_out), (base, base_callbacks, base_out) = runs["stock"], runs["baseline"]
    assert base_callbacks == stock_callbacks
    assert [type(cb) for cb in base.callback_handler.callbacks] == [type(cb) for cb in stock.callback_handler.callbacks]
    listing = [p for p in _listing(tmp_path / "baseline") if not p.startswith("runs/")]  # TensorBoard: host, time
    assert listing == [p for p in _listing(tmp_path / "stock") if not p.startswith("runs/")]
    assert [sorted(e) for e in base.state.log_history] == [sorted(e) for e in stock.state.log_history]
    assert "hf_speedup" not in base_out
    # the report is still there, in memory
    assert base.speedup_report.to_dict()["measurement"]["steps"] == 4


def test_our_callbacks_run_but_stay_off_the_list_and_can_be_removed(rows, collator, tmp_path):
    trainer = SpeedupTrainer(model=_model(), args=_args(tmp_path), train_dataset=rows, data_collator=collator,
                             speedup={"base": "auto", "report": {"path": None, "console": False}})
    stock = Trainer(model=_model(), args=_args(tmp_path / "stock"), train_dataset=rows, data_collator=collator)
    assert [type(cb) for cb in trainer.callback_handler.callbacks] == [type(cb) for cb in
                                                                      stock.callback_handler.callbacks]
    assert trainer.speedup_callback in all_callbacks(trainer)
    trainer.remove_callback(trainer.speedup_callback)
    assert trainer.speedup_callback not in all_callbacks(trainer)
    trainer.train()
    assert trainer.speedup_report.measurement == {}  # nothing collected without the collector


# ----------------------------------------------------------------------------------------- your arguments
@pytest.mark.parametrize("recorded", [False, True], ids=["TrainingArguments", "training_arguments"])
@pytest.mark.parametrize("preset", PRESETS)
def test_what_you_set_in_trainingarguments_is_what_trains(preset, recorded, rows, collator, tmp_path):
    """Every field a preset sets, set by the user to another value: the user's value stays. A value equal to the
    field's default reads as unset in a plain TrainingArguments; ``training_arguments()`` records it as yours."""
    users = dict(optim="adamw_torch", dataloader_pin_memory=False, torch_empty_cache_steps=7, tf32=False)
    if recorded:
        users["activation_checkpointing"] = False  # the default: only a recorded choice is known to be yours
        args = training_arguments("baseline", **{**ARGS, "output_dir": str(tmp_path), **users})
    else:
        args = _args(tmp_path, **users)
    trainer = SpeedupTrainer(model=_model(), args=args, train_dataset=rows, data_collator=collator, speedup=preset)
    for name, value in users.items():
        assert getattr(trainer.args, name) == value, name
    trainer.train()
    opt = unwrap_optimizer(trainer.optimizer)
    assert type(opt) is torch.optim.AdamW and not opt.param_groups[0].get("fused"), preset
    if recorded:
        assert not trainer.speedup_status["checkpointing"].decision.active
        blocks = find_blocks(trainer.model)
        assert blocks and not any(block_checkpoint_fn(b) for b in blocks)



def test_an_8bit_optim_in_trainingarguments_is_the_optimizer_fast_trains_with(rows, collator, tmp_path):
    pytest.importorskip("bitsandbytes")
    trainer = SpeedupTrainer(model=_model(), args=_args(tmp_path, optim="adamw_8bit"), train_dataset=rows,
                             data_collator=collator, speedup="fast")
    opt = unwrap_optimizer(trainer.create_optimizer())
    assert type(opt).__module__.startswith("bitsandbytes") and opt.args.optim_bits == 8
    assert trainer.speedup_status["optimizer"].settings.keep


def test_the_report_file_goes_where_report_path_says(rows, collator, tmp_path):
    target = tmp_path / "reports" / "run.json"
    trainer = SpeedupTrainer(model=_model(), args=_args(tmp_path / "out"), train_dataset=rows,
                             data_collator=collator, speedup={"base": "auto", "report": {"path": str(target)}})
    trainer.train()
    assert json.loads(target.read_text())["preset"] == "auto+custom"
    assert not (tmp_path / "out" / "speedup_report.json").exists()
    os.makedirs(tmp_path / "dir")
    trainer = SpeedupTrainer(model=_model(), args=_args(tmp_path / "out2"), train_dataset=rows,
                             data_collator=collator, speedup={"base": "auto", "report": {"path": str(tmp_path / "dir")}})
    trainer.train()
    assert (tmp_path / "dir" / "speedup_report.json").is_file()


def test_a_recorded_bf16_false_keeps_fp32_where_auto_would_pick_bf16(tmp_path):
    from conftest import CPU_AMX, fake_caps
    from hf_speedup import plan_for

    args = training_arguments("baseline", output_dir=str(tmp_path), use_cpu=True, bf16=False)
    d = plan_for("auto", caps=fake_caps(**CPU_AMX), args=args)["precision"]
    assert d.applied == "fp32" and "auto keeps the TrainingArguments' explicit bf16=False" in d.reason
    assert plan_for("auto", caps=fake_caps(**CPU_AMX), args=_args(tmp_path))["precision"].applied == "bf16"
