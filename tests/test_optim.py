"""optimizer: 8-bit -> fused -> AdamW chain, strict errors, and the optimizer the Trainer really built."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from conftest import CPU_NO_BF16, CUDA_H100, fake_caps
from hf_speedup import SpeedupConfigError, SpeedupTrainer, get_preset
from hf_speedup.plan import plan_for as make_plan
from hf_speedup.compat import unwrap_optimizer
from hf_speedup.features import optimizer as optim
from hf_speedup.plan_types import Outcome

NO_BNB = dict(CUDA_H100, bitsandbytes=False, bitsandbytes_reason="bitsandbytes is not installed (pip install bitsandbytes)")
needs_bnb = pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes not installed")


def plan_for(caps: dict, name: str, args=None, strict: bool = False):
    cfg = get_preset("baseline").replace(optimizer={"name": name, "strict": strict})
    return make_plan(cfg, caps=fake_caps(**caps), args=args)["optimizer"]


# ------------------------------------------------------------------------------------------ plan
@pytest.mark.parametrize("name, hf", [("auto", "adamw_torch_fused"), ("adamw", "adamw_torch"),
                                      ("adamw_fused", "adamw_torch_fused"), ("adamw_8bit", "adamw_bnb_8bit"),
                                      ("paged_adamw_8bit", "paged_adamw_8bit")])
def test_on_h100_every_choice_maps_to_trainingarguments_optim(name, hf, make_args):
    d = plan_for(CUDA_H100, name)
    assert d.fallbacks == () and optim.training_args(d, make_args()) == {"optim": hf}


def test_8bit_without_bitsandbytes_falls_back_to_fused_and_says_why():
    d = plan_for(NO_BNB, "paged_adamw_8bit")
    assert d.applied == "adamw_fused" and d.settings.optim == "adamw_torch_fused"
    assert d.fallbacks == ("paged_adamw_8bit: bitsandbytes is not installed (pip install bitsandbytes)",)
    assert "paged_adamw_8bit cannot run here -> adamw_fused" in d.reason


def test_8bit_on_cpu_falls_back_because_bitsandbytes_needs_cuda():
    d = plan_for(CPU_NO_BF16, "adamw_8bit")
    assert d.applied == "adamw_fused" and "bitsandbytes on CUDA only" in d.fallbacks[0]


def test_chain_ends_at_plain_adamw_when_fused_is_missing_too():
    d = plan_for(dict(NO_BNB, fused_adamw=False), "adamw_8bit")
    assert d.applied == "adamw" and [f.split(":")[0] for f in d.fallbacks] == ["adamw_8bit", "adamw_fused"]


def test_strict_8bit_without_bitsandbytes_is_a_config_error():
    with pytest.raises(SpeedupConfigError, match=r"optimizer\.name = 'adamw_8bit' cannot run on this machine "
                                                 r"\(bitsandbytes is not installed.*allowed here: 'adamw', "
                                                 r"'adamw_fused', 'auto', 'keep'; fix: set optimizer\.name"):
        plan_for(NO_BNB, "adamw_8bit", strict=True)


def test_keep_and_non_adamw_user_choices_are_left_alone(make_args):
    assert optim.training_args(plan_for(CUDA_H100, "keep", args=make_args(optim="adamw_torch")), None) == {}
    kept = plan_for(CUDA_H100, "auto", args=make_args(optim="adafactor"))
    assert kept.applied == "adafactor" and optim.training_args(kept, None) == {}
    assert "kept your TrainingArguments.optim='adafactor' over auto's choice" in kept.reason


@pytest.mark.parametrize("preset", ["auto", "fast", "memory", "qlora", "lora"])
@pytest.mark.parametrize("users", ["adamw_8bit", "rmsprop_bnb_8bit", "adamw_torch", "adafactor"])
def test_an_optim_set_in_trainingarguments_wins_over_every_preset(preset, users, make_args):
    for caps in (CUDA_H100, CPU_NO_BF16):
        d = make_plan(preset, caps=fake_caps(**caps), args=make_args(optim=users))["optimizer"]
        assert d.settings.keep and optim.training_args(d, None) == {} and d.fallbacks == ()
        assert f"kept your TrainingArguments.optim={users!r}" in d.reason


def test_an_optim_in_trainingarguments_and_another_in_your_own_config_is_refused_up_front(make_args):
    with pytest.raises(SpeedupConfigError, match=r"optimizer\.name = 'adamw' \(your config\) and TrainingArguments"
                                                 r"\.optim = 'adamw_8bit' ask for different optimizers; allowed: one "
                                                 r"choice; fix: drop optim from TrainingArguments, or set "
                                                 r"optimizer\.name: keep"):
        plan_for(CUDA_H100, "adamw", args=make_args(optim="adamw_8bit"))
    same = plan_for(CUDA_H100, "adamw_8bit", args=make_args(optim="adamw_bnb_8bit"))  # one optimizer, two spellings
    assert same.settings.keep
    # the arguments' default optim reads as not set: the config's choice applies
    assert plan_for(CUDA_H100, "adamw", args=make_args(optim="adamw_torch_fused")).settings.optim == "adamw_torch"


def test_a_bitsandbytes_optim_in_trainingarguments_under_fsdp2_is_refused_up_front(make_args):
    with pytest.raises(SpeedupConfigError, match=r"TrainingArguments\.optim = 'adamw_8bit' cannot run under FSDP2: "
                                                 r"bitsandbytes' 8-bit optimizer state does not take FSDP2's sharded "
                                                 r".*fix: drop optim from TrainingArguments"):
        make_plan("fsdp", caps=fake_caps(**dict(CUDA_H100, world_size=2)),
                   args=make_args(optim="adamw_8bit"))


def test_multi_process_decides_the_same():
    assert plan_for(dict(CUDA_H100, world_size=2), "adamw_8bit").settings == plan_for(CUDA_H100, "adamw_8bit").settings


def _under_fsdp(name: str, version: int, strict: bool = False):
    from hf_speedup.features.fsdp import Settings as FsdpSettings
    from hf_speedup.plan_types import Decision, PlanContext

    cfg = get_preset("baseline").replace(optimizer={"name": name, "strict": strict})
    ctx = PlanContext(config=cfg, caps=fake_caps(**dict(CUDA_H100, world_size=2)), model=None, args=None)
    ctx.decisions["fsdp"] = Decision("fsdp", True, f"fsdp{version}:full_shard", "sharded",
                                     settings=FsdpSettings(version=version))
    return optim.decide(ctx)


def test_8bit_state_falls_back_under_fsdp2_whose_dtensors_bitsandbytes_cannot_step():
    for name in ("adamw_8bit", "paged_adamw_8bit"):
        d = _under_fsdp(name, version=2)
        assert d.applied == "adamw_fused" and "does not take FSDP2's sharded parameters" in d.fallbacks[0]
    assert _under_fsdp("adamw_8bit", version=1).applied == "adamw_8bit"  # FSDP1's flat parameters are plain tensors
    with pytest.raises(SpeedupConfigError, match=r"optimizer.name = 'adamw_8bit' cannot run on this machine "
                                                 r"\(bitsandbytes' 8-bit optimizer state does not take FSDP2"):
        _under_fsdp("adamw_8bit", version=2, strict=True)


def test_transformers_builds_fused_adamw_from_the_optim_name(make_args):
    """The contract we rely on: optim='adamw_torch_fused' -> torch.optim.AdamW(fused=True), also on CPU."""
    from transformers import Trainer

    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(make_args(optim="adamw_torch_fused"))
    assert cls is torch.optim.AdamW and kwargs["fused"] is True


# ------------------------------------------------------------------------------------------ real objects
def _trainer(cfg, tiny_model, dataset, collator, make_args, **args_kw):
    return SpeedupTrainer(model=tiny_model, args=make_args(max_steps=2, **args_kw), train_dataset=dataset,
                          data_collator=collator, speedup=cfg)


def test_fused_adamw_really_is_fused_after_training(tiny_model, dataset, collator, make_args):
    cfg = get_preset("baseline").replace(optimizer={"name": "adamw_fused"})
    trainer = _trainer(cfg, tiny_model, dataset, collator, make_args)
    d = trainer.speedup_status["optimizer"]
    assert d.engaged is False and "not created yet" in d.engaged_reason  # verified at init: no optimizer yet
    trainer.train()
    opt = unwrap_optimizer(trainer.optimizer)
    assert type(opt) is torch.optim.AdamW and opt.param_groups[0]["fused"] is True
    assert d.engaged is True and "fused=True" in d.engaged_reason


def test_plain_adamw_is_in_force_but_not_engaged(tiny_model, dataset, collator, make_args):
    cfg = get_preset("baseline").replace(optimizer={"name": "adamw"})
    trainer = _trainer(cfg, tiny_model, dataset, collator, make_args)  # args default: adamw_torch_fused
    trainer.train()
    assert not unwrap_optimizer(trainer.optimizer).param_groups[0]["fused"]
    d = trainer.speedup_status["optimizer"]
    assert d.engaged is False and "plain AdamW in force as planned" in d.engaged_reason


def test_an_optimizer_passed_by_the_user_is_reported_as_a_mismatch(tiny_model, dataset, collator, make_args):
    sgd = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=1), train_dataset=dataset,
                             data_collator=collator, optimizers=(sgd, None), speedup="auto")
    d = trainer.speedup_status["optimizer"]
    assert d.engaged is False and "MISMATCH: planned adamw_fused, found torch.optim.sgd.SGD" in d.engaged_reason


@needs_bnb
def test_8bit_adamw_verified_from_the_live_bitsandbytes_optimizer(monkeypatch, tiny_model, dataset, collator, make_args):
    """bitsandbytes >= 0.45 runs 8-bit AdamW on CPU too, so the verify path runs on real objects here."""
    monkeypatch.setattr("hf_speedup.trainer.probe", lambda args=None: fake_caps(**dict(CPU_NO_BF16, bitsandbytes=True)))
    cfg = get_preset("baseline").replace(optimizer={"name": "adamw_8bit"})
    trainer = _trainer(cfg, tiny_model, dataset, collator, make_args)
    trainer.train()
    opt = unwrap_optimizer(trainer.optimizer)
    assert type(opt).__module__.startswith("bitsandbytes") and opt.args.optim_bits == 8
    d = trainer.speedup_status["optimizer"]
    assert d.engaged is True, d.engaged_reason
    trainer.verify_speedup()  # after steps the state exists: big matrices hold uint8 state
    assert "parameter states in 8 bits" in d.engaged_reason
    assert any(s["state1"].dtype == torch.uint8 for s in opt.state.values())


@needs_bnb
def test_paged_8bit_on_cpu_parameters_is_not_reported_as_paged(monkeypatch, tiny_model, dataset, collator, make_args):
    monkeypatch.setattr("hf_speedup.trainer.probe", lambda args=None: fake_caps(**dict(CPU_NO_BF16, bitsandbytes=True)))
    cfg = get_preset("baseline").replace(optimizer={"name": "paged_adamw_8bit"})
    trainer = _trainer(cfg, tiny_model, dataset, collator, make_args)
    trainer.create_optimizer()  # enough to inspect; bitsandbytes would warn and run unpaged on CPU
    engaged, reason = optim.verify(trainer.speedup_plan["optimizer"], trainer, Outcome())
    assert engaged is False and "paging is CUDA-only" in reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name, cls_check", [("adamw_fused", "fused=True"),
                                             pytest.param("adamw_8bit", "optim_bits=8", marks=needs_bnb),
                                             pytest.param("paged_adamw_8bit", "is_paged=True", marks=needs_bnb)])
def test_cuda_optimizers_engage(name, cls_check, tiny_model, dataset, collator, make_args):
    cfg = get_preset("baseline").replace(optimizer={"name": name})
    trainer = _trainer(cfg, tiny_model, dataset, collator, make_args, use_cpu=False)
    trainer.train()
    d = trainer.speedup_status["optimizer"]
    assert d.applied == name and d.engaged is True and cls_check in d.engaged_reason, d.engaged_reason
