"""Activation checkpointing: decisions, real recomputation on the chosen blocks, unchanged math."""

from __future__ import annotations

import pytest
import torch
from conftest import CPU_NO_BF16, fake_caps

from hf_speedup import SpeedupTrainer, plan_for, get_preset
from hf_speedup.features import Setup, checkpointing
from hf_speedup.features import fsdp as fsdp_feature
from hf_speedup.model_info import describe_model
from hf_speedup.plan_types import Decision, Outcome, PlanContext


def ckpt_cfg(every_n=1, enabled=True, **sections):
    return get_preset("baseline").replace(checkpointing={"enabled": enabled, "every_n_blocks": every_n}, **sections)


def decide(cfg, model=None, args=None, fsdp=None):
    ctx = PlanContext(config=cfg, caps=fake_caps(**CPU_NO_BF16), model=describe_model(model) if model is not None else None,
                      args=args)
    if fsdp is not None:
        ctx.decisions["fsdp"] = fsdp
    return checkpointing.decide(ctx)


def applied(model, every_n=1):
    d = plan_for(ckpt_cfg(every_n), caps=fake_caps(**CPU_NO_BF16), model=model)["checkpointing"]
    setup, outcome = Setup(model=model, args=None), Outcome()
    checkpointing.apply(d, setup, outcome)
    return setup.model, d, outcome


class _T:  # the part of a Trainer verify reads
    def __init__(self, model):
        self.model = model


# ----------------------------------------------------------------------------------------- decide
def test_off_by_default_and_auto_off_with_reason(tiny_model):
    assert decide(get_preset("baseline"), tiny_model).applied == "off"
    d = decide(ckpt_cfg(enabled="auto"), tiny_model)
    assert d.applied == "off" and d.reason.startswith("auto: off")


def test_every_block_and_every_second_block(tiny_model):
    d1 = decide(ckpt_cfg(1), tiny_model)
    assert (d1.applied, d1.settings.blocks) == ("non-reentrant", (0, 1, 2, 3))
    d2 = decide(ckpt_cfg(2), tiny_model)
    assert (d2.applied, d2.settings.blocks) == ("non-reentrant, every 2 blocks", (0, 2))
    assert "2/4 LlamaDecoderLayer blocks (every 2nd), non-reentrant, use_cache off" in d2.reason
    assert decide(ckpt_cfg(3), tiny_model).settings.blocks == (0, 3)


def test_fsdp_checkpointing_is_not_repeated_here(tiny_model, make_args):
    fsdp = Decision("fsdp", requested=True, applied="full_shard", reason="", settings=fsdp_feature.Settings(activation_checkpointing=True))
    d = decide(ckpt_cfg(1), tiny_model, make_args(gradient_checkpointing=True), fsdp=fsdp)
    assert d.applied == "by fsdp" and "FSDP" in d.reason
    assert checkpointing.training_args(d, make_args(gradient_checkpointing=True)) == {
        "activation_checkpointing": False, "gradient_checkpointing": False}
    setup, outcome = Setup(model=tiny_model, args=None), Outcome()
    checkpointing.apply(d, setup, outcome)
    assert checkpointing.checkpointed_blocks(tiny_model) == []  # apply left it to FSDP
    no_ac = Decision("fsdp", requested=True, applied="full_shard", reason="", settings=fsdp_feature.Settings(activation_checkpointing=False))
    assert decide(ckpt_cfg(1), tiny_model, fsdp=no_ac).settings.by == "hf_speedup"


def test_users_trainingarguments_flag_is_handled_explicitly(tiny_model, make_args):
    on = make_args(gradient_checkpointing=True)
    stock = decide(get_preset("baseline"), tiny_model, on)  # baseline: the stock Trainer does it
    assert stock.applied == "by trainer" and checkpointing.training_args(stock, on) == {}
    taken = decide(ckpt_cfg(2), tiny_model, on)  # ours: per block here, the Trainer's switch off
    assert taken.settings.by == "hf_speedup" and "taken over from TrainingArguments" in taken.reason
    assert checkpointing.training_args(taken, on) == {"activation_checkpointing": False, "gradient_checkpointing": False}
    assert checkpointing.training_args(taken, make_args()) == {}
    assert decide(ckpt_cfg(enabled="auto"), tiny_model, on).settings.by == "hf_speedup"


def test_stock_trainer_equivalent_for_trainingarguments_presets(tiny_model, make_args, dataset, collator):
    from transformers import Trainer

    d = decide(ckpt_cfg(2), tiny_model)
    over = checkpointing.stock_trainer_args(d, make_args())
    assert over == {"activation_checkpointing": True,
                    "activation_checkpointing_kwargs": {"use_reentrant": False, "every_n_layers": 2}}
    assert checkpointing.stock_trainer_args(decide(get_preset("baseline"), tiny_model)) == {}
    trainer = Trainer(model=tiny_model, args=make_args(max_steps=1, **over), train_dataset=dataset, data_collator=collator)
    trainer.train()  # the stock Trainer switches it on in train(): the same blocks as ours
    assert checkpointing.checkpointed_blocks(tiny_model) == [0, 2]


def test_trainer_runs_every_nth_block_even_when_args_asked_for_all(tiny_model, make_args, dataset, collator):
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(gradient_checkpointing=True, max_steps=2),
                             train_dataset=dataset, data_collator=collator, speedup=ckpt_cfg(2))
    assert trainer.args.gradient_checkpointing is False
    assert checkpointing.checkpointed_blocks(trainer.model) == [0, 2]
    d = trainer.speedup_status["checkpointing"]
    assert d.engaged, d.engaged_reason
    assert "2/4 LlamaDecoderLayer blocks (0, 2, every 2nd), non-reentrant" in d.engaged_reason
    assert "recomputed exactly blocks 0, 2" in d.engaged_reason
    trainer.train()


def test_stock_trainer_checkpointing_is_reported(tiny_model, make_args, dataset, collator):
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(gradient_checkpointing=True), train_dataset=dataset,
                             data_collator=collator, speedup="baseline")
    d = trainer.speedup_status["checkpointing"]
    assert d.applied == "by trainer" and not d.engaged  # the Trainer only switches it on in train()
    assert d.engaged_reason == "the stock Trainer turns it on when train() starts; not on yet"
    trainer.train()
    ok, why = checkpointing.verify(trainer.speedup_plan["checkpointing"], trainer, trainer.speedup_outcomes["checkpointing"])
    assert ok and why.startswith("4/4 LlamaDecoderLayer blocks (0, 1, 2, 3), non-reentrant"), why


# ----------------------------------------------------------------------------------------- behaviour
@pytest.mark.parametrize("every_n, expected", [(1, {0: 2, 1: 2, 2: 2, 3: 2}), (2, {0: 2, 1: 1, 2: 2, 3: 1})])
def test_recomputes_exactly_the_chosen_blocks(tiny_model, every_n, expected):
    model, d, outcome = applied(tiny_model, every_n)
    assert checkpointing.count_block_runs(model) == expected
    ok, why = checkpointing.verify(d, _T(model), outcome)
    assert ok, why
    assert not tiny_model.config.use_cache


def test_without_checkpointing_every_block_runs_once(tiny_model):
    assert checkpointing.count_block_runs(tiny_model) == {0: 1, 1: 1, 2: 1, 3: 1}


def test_verify_fails_when_the_blocks_are_not_checkpointed(tiny_model):
    d = decide(ckpt_cfg(2), tiny_model)  # decided, never applied
    ok, why = checkpointing.verify(d, _T(tiny_model), Outcome())
    assert not ok and why == "no block has checkpointing on (0/4)"
    model, d, outcome = applied(tiny_model, 2)
    outcome.facts["blocks"] = [0, 1, 2, 3]  # claim more than is there: the probe must disagree
    ok, why = checkpointing.verify(d, _T(model), outcome)
    assert not ok and "recomputed blocks [0, 2], expected [0, 1, 2, 3]" in why


def _loss_and_grads(model, batch):
    model.train()
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batch(dataset, collator, n=4):
    return collator([dataset[i] for i in range(n)])


@pytest.mark.parametrize("every_n", [1, 2])
def test_grads_match_no_checkpointing(every_n, dataset, collator):
    from hf_speedup.tiny import tiny_llama

    kw = dict(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              attention_dropout=0.1)  # dropout: recomputation must replay the same RNG
    batch = _batch(dataset, collator)
    plain, (model, _, _) = tiny_llama(**kw), applied(tiny_llama(**kw), every_n)
    torch.manual_seed(1)
    ref_loss, ref = _loss_and_grads(plain, batch)
    torch.manual_seed(1)
    loss, grads = _loss_and_grads(model, batch)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref.keys()
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], rtol=0, atol=1e-6, msg=n)


def test_lora_and_checkpointing_train_together(tiny_model, make_args, dataset, collator):
    from hf_speedup.tiny import tiny_llama

    cfg = ckpt_cfg(2, lora={"enabled": True, "dropout": 0.0})
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=4), train_dataset=dataset,
                             data_collator=collator, speedup=cfg)
    plan = trainer.speedup_status
    assert plan["lora"].engaged and plan["checkpointing"].engaged, plan["checkpointing"].engaged_reason
    # The same adapters without checkpointing give the same gradients (non-reentrant needs no input-grad hook).
    ref = SpeedupTrainer(model=tiny_llama(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                          num_key_value_heads=2),
                         args=make_args(max_steps=4), train_dataset=dataset, data_collator=collator,
                         speedup=get_preset("baseline").replace(lora={"enabled": True, "dropout": 0.0}))
    for m in (trainer.model, ref.model):  # B starts at zero: perturb it identically so A gets gradients too
        torch.manual_seed(3)
        for n, p in sorted(m.named_parameters()):
            if "lora_B" in n:
                p.data.normal_(0, 0.1)
    batch = _batch(dataset, collator)
    _, g = _loss_and_grads(trainer.model, batch)
    _, g_ref = _loss_and_grads(ref.model, batch)
    assert g.keys() == g_ref.keys() and all("lora_" in n for n in g)
    for n in g:
        torch.testing.assert_close(g[n], g_ref[n], rtol=0, atol=1e-6, msg=n)
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))


# ----------------------------------------------------------------------------------------- compile
def _saved_activation_numel(model, batch) -> int:
    """Elements autograd keeps for backward that are not parameters (what checkpointing saves)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    total = 0

    def pack(t):
        nonlocal total
        if t.untyped_storage().data_ptr() not in params:
            total += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch).loss.backward()
    return total


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_checkpointing_inside_regionally_compiled_blocks(backend, dataset, collator):
    """Blocks compiled in place after checkpointing keep the same math and save fewer activations."""
    from hf_speedup.blocks import find_blocks
    from hf_speedup.tiny import tiny_llama

    kw = dict(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    batch = _batch(dataset, collator)
    ref_loss, ref = _loss_and_grads(tiny_llama(**kw), batch)
    torch._dynamo.reset()
    plain, ckpt = tiny_llama(**kw), applied(tiny_llama(**kw), 1)[0]
    for m in (plain, ckpt):
        m.train()
        for b in find_blocks(m):
            b.compile(backend=backend)
    loss, grads = _loss_and_grads(ckpt, batch)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-6)
    for n in ref:
        torch.testing.assert_close(grads[n], ref[n], rtol=0, atol=1e-5, msg=n)
    saved_plain = _saved_activation_numel(plain, batch)
    saved_ckpt = _saved_activation_numel(ckpt, batch)
    assert saved_ckpt < 0.8 * saved_plain, (saved_ckpt, saved_plain)


def test_verification_probe_does_not_compile(dataset, collator):
    """The probe step runs compiled blocks eagerly: verifying must not cost a compile or a recompile."""
    from hf_speedup.blocks import find_blocks
    from hf_speedup.tiny import tiny_llama

    torch._dynamo.reset()
    model, d, outcome = applied(tiny_llama(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                           num_key_value_heads=2), 2)
    for b in find_blocks(model):
        b.compile(backend="aot_eager")
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    ok, why = checkpointing.verify(d, _T(model), outcome)
    assert ok, why
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == frames


# ----------------------------------------------------------------------------------------- other blocks
class _Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class _Plain(torch.nn.Module):
    """Not a transformers model: blocks in a homogeneous ModuleList, no GradientCheckpointingLayer."""

    def __init__(self, d=16, n=4):
        super().__init__()
        self.emb, self.blocks = torch.nn.Embedding(32, d), torch.nn.ModuleList(_Block(d) for _ in range(n))

    def get_input_embeddings(self):
        return self.emb

    def forward(self, input_ids, use_cache=None):
        h = self.emb(input_ids)
        for b in self.blocks:
            h = b(h)
        return (h,)


def test_plain_module_blocks_get_a_checkpointed_forward():
    torch.manual_seed(0)
    ref, model = _Plain(), _Plain()
    model.load_state_dict(ref.state_dict())
    d = decide(ckpt_cfg(2), model)
    outcome = Outcome()
    checkpointing.apply(d, Setup(model=model, args=None), outcome)
    assert outcome.facts["mechanism"] == "forward wrapper" and checkpointing.checkpointed_blocks(model) == [0, 2]
    assert checkpointing.count_block_runs(model) == {0: 2, 1: 1, 2: 2, 3: 1}
    x = torch.randint(0, 32, (2, 5))
    for m in (ref, model):
        m(x)[0].square().mean().backward()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)
    ok, why = checkpointing.verify(d, _T(model), outcome)
    assert ok and why.startswith("2/4 _Block blocks (0, 2, every 2nd), non-reentrant"), why


def test_checkpointing_kwargs_beyond_per_block_ones_stay_with_the_trainer_or_are_cleared_with_the_switch(
        tiny_model, make_args):
    """TRL's ``selective`` (or any kwarg per-block non-reentrant checkpointing is not): auto leaves the trainer's
    own checkpointing alone; an explicit request takes over and clears the kwargs with the switch, since TRL
    refuses kwargs whose switch is off."""
    asked = make_args(gradient_checkpointing=True, gradient_checkpointing_kwargs={"selective": True})
    auto = decide(ckpt_cfg(enabled="auto"), tiny_model, asked)
    assert auto.applied == "by trainer" and "{'selective': True}" in auto.reason
    assert checkpointing.training_args(auto, asked) == {}
    taken = decide(ckpt_cfg(1), tiny_model, asked)
    assert taken.settings.by == "hf_speedup" and "their {'selective': True} replaced" in taken.reason
    assert checkpointing.training_args(taken, asked) == {
        "activation_checkpointing": False, "gradient_checkpointing": False, "activation_checkpointing_kwargs": None,
        "gradient_checkpointing_kwargs": None}
    plain = make_args(gradient_checkpointing=True, gradient_checkpointing_kwargs={"use_reentrant": False})
    assert decide(ckpt_cfg(enabled="auto"), tiny_model, plain).settings.by == "hf_speedup"


def test_trl_selective_checkpointing_trains_under_the_memory_preset(tiny_model, tmp_path):
    trl = pytest.importorskip("trl")
    from hf_speedup import SpeedupSFTTrainer
    from hf_speedup.tiny import chat_dataset, chat_tokenizer

    args = trl.SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, report_to=[],
                         use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, max_length=None,
                         gradient_checkpointing_kwargs={"selective": True})
    trainer = SpeedupSFTTrainer(model=tiny_model, args=args, train_dataset=chat_dataset(8, seed=0),
                                processing_class=chat_tokenizer(), speedup="memory")
    trainer.train()
    assert trainer.speedup_status["checkpointing"].engaged
    assert checkpointing.checkpointed_blocks(trainer.model) == [0, 1, 2, 3]
