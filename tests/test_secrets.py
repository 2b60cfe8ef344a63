"""No credential reaches a file: hub_token, HF_TOKEN and WANDB_API_KEY planted, every output file scanned.

The stock Trainer pickles ``hub_token`` into every ``checkpoint-*/training_args.bin``; SpeedupTrainer trains
with a copy whose credentials pickle as ``None`` (``hf_speedup/credentials.py``), while the token itself still
works where the Trainer uses it (Hub uploads).
"""

from __future__ import annotations

import copy
import logging
import pickle
import signal
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainerCallback

from hf_speedup import SpeedupTrainer
from hf_speedup.credentials import Credential, credential_fields, redacted_overrides
from hf_speedup.features.interrupt import TrainingInterrupted
from hf_speedup.tiny import tiny_llama

SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
HUB_TOKEN = "hf_planted_hub_token_7f3c9a1e5b"
HF_TOKEN = "hf_planted_env_token_2d8e6b4f0a"
WANDB_API_KEY = "0123456789abcdef0123456789abcdefplanted1"  # 40 characters, the form W&B expects
SECRETS = (HUB_TOKEN, HF_TOKEN, WANDB_API_KEY)


def _leaks(*roots: Path) -> dict[str, list[str]]:
    """file -> the secrets found in its bytes (as UTF-8 and UTF-16, the encodings a file may hold text in)."""
    found: dict[str, list[str]] = {}
    files = [p for root in roots for p in root.rglob("*") if p.is_file()]
    assert files, f"nothing to scan under {roots}"
    for path in files:
        data = path.read_bytes()
        hits = [s for s in SECRETS if any(s.encode(enc) in data for enc in ("utf-8", "utf-16-le"))]
        if hits:
            found[str(path)] = hits
    return found


class _SigtermAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            signal.raise_signal(signal.SIGTERM)


@pytest.fixture
def planted(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv("WANDB_API_KEY", WANDB_API_KEY)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_root"))
    monkeypatch.setenv("WANDB_PROJECT", "hf_speedup_secrets")
    (tmp_path / "wandb_root").mkdir()
    import wandb

    wandb.teardown()  # settings (run directory, API key) are read afresh from this environment ...
    yield tmp_path
    if wandb.run is not None:
        wandb.finish()
    wandb.teardown()  # ... and none of them is left in wandb's process-wide singleton for the next test


def test_stock_trainer_pickles_hub_token_so_the_scan_can_fail(make_args, dataset, collator, tmp_path):
    """The control: what SpeedupTrainer must not do, the stock Trainer does."""
    out = tmp_path / "stock"
    trainer = Trainer(model=tiny_llama(seed=0, **SMALL), args=make_args(output_dir=str(out), max_steps=1,
                                                                         hub_token=HUB_TOKEN),
                      train_dataset=dataset, data_collator=collator)
    trainer.train()
    trainer.save_model()
    assert _leaks(out) == {str(out / "training_args.bin"): [HUB_TOKEN]}


def test_no_planted_secret_in_any_output_or_wandb_file(planted, make_args, dataset, collator, caplog, capsys):
    wandb = pytest.importorskip("wandb")
    out = planted / "out"
    args = make_args(output_dir=str(out), max_steps=6, save_strategy="steps", save_steps=2, report_to=["wandb"],
                     hub_token=HUB_TOKEN, run_name="secrets")
    caplog.set_level(logging.DEBUG)
    trainer = SpeedupTrainer(model=tiny_llama(seed=0, **SMALL), args=args, train_dataset=dataset,
                             data_collator=collator, callbacks=[_SigtermAt(3)], speedup="auto")
    try:
        with pytest.raises(TrainingInterrupted):  # a regular checkpoint (2) and the interrupt's own (3)
            trainer.train()
        trainer.save_model(str(out / "final"))
    finally:
        wandb.finish()
    assert {p.name for p in out.glob("checkpoint-*")} == {"checkpoint-2", "checkpoint-3"}
    runs = list((planted / "wandb_root" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].rglob("*.wandb"))

    assert _leaks(out, planted / "wandb_root") == {}
    logged = caplog.text + "".join(capsys.readouterr())
    assert logged and not [s for s in SECRETS if s in logged]

    # the token still works where the Trainer uses it, and the pickled arguments are otherwise intact
    assert trainer.args.hub_token == HUB_TOKEN and isinstance(trainer.args.hub_token, Credential)
    saved = torch.load(out / "checkpoint-2" / "training_args.bin", weights_only=False)
    assert saved.hub_token is None
    assert (saved.learning_rate, saved.save_steps, saved.output_dir) == (args.learning_rate, 2, str(out))


def test_baseline_redacts_too_and_the_users_arguments_are_untouched(make_args, dataset, collator, tmp_path):
    out = tmp_path / "base"
    args = make_args(output_dir=str(out), max_steps=2, save_strategy="steps", save_steps=2, hub_token=HUB_TOKEN)
    trainer = SpeedupTrainer(model=tiny_llama(seed=0, **SMALL), args=args, train_dataset=dataset,
                             data_collator=collator, speedup="baseline")
    trainer.train()
    assert _leaks(out) == {}
    assert type(args.hub_token) is str and trainer.args is not args  # redacted in the trainer's copy only


def test_credential_is_its_value_in_use_and_none_when_pickled():
    token = Credential(HUB_TOKEN)
    assert token == HUB_TOKEN and f"Bearer {token}" == f"Bearer {HUB_TOKEN}" and HUB_TOKEN not in repr(token)
    assert pickle.loads(pickle.dumps({"hub_token": token})) == {"hub_token": None}
    assert HUB_TOKEN.encode() not in pickle.dumps(token, protocol=2)
    assert copy.deepcopy(token) is token  # a deep copy of the arguments keeps a working token


def test_only_credential_fields_are_wrapped(make_args):
    from dataclasses import dataclass

    from transformers import TrainingArguments

    @dataclass
    class WithVocab(TrainingArguments):  # like TRL's configs: vocabulary "tokens" are not secrets
        pad_token: str | None = None
        tracker_api_key: str | None = None

    args = WithVocab(output_dir="unused", hub_token=HUB_TOKEN, pad_token="<pad>", tracker_api_key="k3y", report_to=[])
    assert sorted(credential_fields(args)) == ["hub_token", "tracker_api_key"]
    over = redacted_overrides(args)
    assert set(over) == {"hub_token", "tracker_api_key"} and all(isinstance(v, Credential) for v in over.values())
    assert redacted_overrides(make_args()) == {}  # nothing set, nothing to do
