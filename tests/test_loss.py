"""Chunked cross-entropy (``loss`` feature): the stock loss and gradients, without the full logits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import CPU_NO_BF16, CUDA_H100, assert_same_in_dtype, fake_caps
from hf_speedup import SpeedupConfigError, SpeedupConfig, plan_for
from hf_speedup.features import loss as loss_feature
from hf_speedup.features.loss.chunked_cross_entropy import (chunked_causal_lm_loss, install, installed_state, uninstall,
                                                            unsupported_reason)
from hf_speedup.plan_types import Decision, PlanContext
from hf_speedup.tiny import tiny_llama


def small_llama(vocab: int = 512, **kw):
    return tiny_llama(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=vocab, **kw)


def batch(vocab: int, rows: int = 3, length: int = 37, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    labels = ids.clone()
    labels[0, :10] = -100  # a masked prompt
    labels[-1, length - 6:] = -100  # right padding
    return ids, labels


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def stock_and_chunked(vocab: int, chunk_tokens: int):
    stock = small_llama(vocab).train()
    chunked = copy.deepcopy(stock)
    install(chunked, chunk_tokens)
    return stock, chunked


# ------------------------------------------------------------------------------------------ the math
@pytest.mark.parametrize("vocab", [512, 6000])
@pytest.mark.parametrize("chunk_tokens", [7, 4096])
@pytest.mark.parametrize("num_items", [None, 71])
def test_loss_and_every_gradient_match_the_stock_model(vocab, chunk_tokens, num_items):
    stock, chunked = stock_and_chunked(vocab, chunk_tokens)
    ids, labels = batch(vocab)
    kw = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    want = stock(input_ids=ids, labels=labels, **kw)
    got = chunked(input_ids=ids, labels=labels, **kw)
    want.loss.backward()
    got.loss.backward()
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    expected = grads(stock)
    actual = grads(chunked)
    assert actual.keys() == expected.keys() and "lm_head.weight" in actual
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)
    assert got.logits is None and want.logits.shape == (*ids.shape, vocab)
    assert installed_state(chunked).chunked_calls == 1


def test_gradient_accumulation_with_num_items_in_batch_equals_the_whole_batch():
    """Two micro-batches, each divided by the tokens of both (the Trainer's num_items_in_batch), sum to the
    whole batch's mean loss and gradient: gradient accumulation is exact, as with transformers' loss."""
    _, whole = stock_and_chunked(512, 16)
    micro = copy.deepcopy(whole)
    ids, labels = batch(512, rows=4)
    whole(input_ids=ids, labels=labels).loss.backward()
    n_items = (labels[:, 1:] != -100).sum()
    total = sum(micro(input_ids=ids[i:i + 2], labels=labels[i:i + 2], num_items_in_batch=n_items).loss
                for i in (0, 2))
    total.backward()
    want, got = grads(whole), grads(micro)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)


def stock_loss(hidden, weight, bias, labels, **kw):
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss(F.linear(hidden, weight, bias), labels, weight.shape[0], **kw)


def test_bias_shift_labels_and_the_ignored_tokens_like_transformers():
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    weight = torch.randn(300, 16, requires_grad=True)
    bias = torch.randn(300, requires_grad=True)
    shift = torch.randint(0, 300, (2, 9))
    shift[1, 4:] = -100
    for kw in ({"shift_labels": shift}, {"shift_labels": shift, "num_items_in_batch": 5}):
        want = stock_loss(hidden, weight, bias, None, **kw)
        got = chunked_causal_lm_loss(hidden, weight, bias, None, chunk_tokens=4, **kw)
        g_want = torch.autograd.grad(want, (hidden, weight, bias))
        g_got = torch.autograd.grad(got, (hidden, weight, bias))
        torch.testing.assert_close(got, want)
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    nothing = torch.full((2, 9), -100)
    assert torch.isnan(chunked_causal_lm_loss(hidden, weight, bias, nothing))  # mean of no token: NaN, as stock
    assert torch.isnan(stock_loss(hidden, weight, bias, nothing))
    assert chunked_causal_lm_loss(hidden, weight, bias, nothing, num_items_in_batch=4).item() == 0.0


def test_bf16_autocast_casts_like_nn_linear():
    torch.manual_seed(0)
    hidden = torch.randn(2, 40, 32, requires_grad=True)
    weight = torch.randn(1000, 32, requires_grad=True)
    labels = torch.randint(0, 1000, (2, 40))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = stock_loss(hidden, weight, None, labels)
        got = chunked_causal_lm_loss(hidden, weight, None, labels, chunk_tokens=16)
    assert got.dtype == torch.float32
    assert_same_in_dtype(got, want, "bf16", "loss")
    for a, b, name in zip(torch.autograd.grad(got, (hidden, weight)), torch.autograd.grad(want, (hidden, weight)),
                          ("hidden", "weight")):
        assert a.dtype == b.dtype == torch.float32
        assert_same_in_dtype(a, b, "bf16", name)


def test_the_full_logits_never_exist():
    """No tensor of tokens x vocab elements is created in forward or backward (chunks of 16 tokens)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    vocab = 6000
    stock, chunked = stock_and_chunked(vocab, 16)
    ids, labels = batch(vocab, rows=8)
    with Largest():
        chunked(input_ids=ids, labels=labels).loss.backward()
    weight = chunked.lm_head.weight.numel()  # the weight and its gradient: vocab x hidden
    assert Largest.numel == max(16 * vocab, weight) and weight < ids.numel() * vocab
    Largest.numel = 0
    with Largest():
        stock(input_ids=ids, labels=labels).loss.backward()
    assert Largest.numel >= ids.numel() * vocab  # the check sees the stock logits


# ------------------------------------------------------------------------------------------ wiring
def test_eval_mode_and_no_labels_are_the_stock_model():
    stock, chunked = stock_and_chunked(512, 8)
    ids, labels = batch(512)
    out = chunked(input_ids=ids)  # training mode, no labels: logits as usual
    torch.testing.assert_close(out.logits, stock(input_ids=ids).logits)
    stock.eval(), chunked.eval()
    got, want = chunked(input_ids=ids, labels=labels), stock(input_ids=ids, labels=labels)
    torch.testing.assert_close(got.logits, want.logits)
    torch.testing.assert_close(got.loss, want.loss)
    assert installed_state(chunked).chunked_calls == 0


def test_tuple_outputs_keep_their_positions():
    _, chunked = stock_and_chunked(512, 8)
    ids, labels = batch(512)
    loss, logits, *_ = chunked(input_ids=ids, labels=labels, return_dict=False)
    assert loss.ndim == 0 and logits is None


def test_signature_kept_for_the_trainer_and_uninstall_restores_the_stock_model():
    import inspect

    model = small_llama()
    stock_sig = inspect.signature(model.forward)
    install(model, 8)
    assert inspect.signature(model.forward) == stock_sig  # Trainer passes num_items_in_batch by this
    assert uninstall(model) and installed_state(model) is None
    assert "forward" not in vars(model) and "forward" not in vars(model.lm_head)
    assert "_loss_function" not in vars(model)
    assert not uninstall(model)


def test_a_deep_copy_trains_on_its_own_weights():
    """TRL and EMA copies: the copy's chunked loss uses the copy's lm_head, not the original's."""
    _, model = stock_and_chunked(512, 8)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.mul_(0.5)
    ids, labels = batch(512)
    twin(input_ids=ids, labels=labels).loss.backward()
    assert twin.lm_head.weight.grad is not None and model.lm_head.weight.grad is None
    assert installed_state(twin).head is twin.lm_head and installed_state(twin).chunked_calls == 1


def test_models_that_change_their_logits_keep_the_stock_loss():
    model = small_llama()
    model.config.final_logit_softcapping = 30.0
    assert "post-processes its logits (final_logit_softcapping)" in unsupported_reason(model)
    model.config.final_logit_softcapping = None
    model.lm_head.forward = lambda x: x  # someone else's patch
    assert "lm_head's forward is already replaced" in unsupported_reason(model)


# ------------------------------------------------------------------------------------------ plan
def plan_ctx(caps=CPU_NO_BF16, **decisions) -> PlanContext:
    cfg = SpeedupConfig.from_dict({"loss": {"chunked": True, "chunk_tokens": 256}})
    return PlanContext(config=cfg, caps=fake_caps(**caps), model=None, args=None, decisions=decisions)


def test_decide_on_off_auto_and_why_not_liger_on_cpu(tiny_model):
    plan = plan_for({"base": "baseline", "loss": {"chunked": True, "chunk_tokens": 256}},
                      fake_caps(**CPU_NO_BF16), tiny_model)
    d = plan["loss"]
    assert d.active and d.settings.chunked and d.settings.chunk_tokens == 256
    assert d.reason.endswith("Liger's fused linear cross-entropy not used: off in the config")
    assert not plan_for("auto", fake_caps(**CPU_NO_BF16), tiny_model)["loss"].active  # auto: the budget decides
    memory = plan_for("memory", fake_caps(**CPU_NO_BF16), tiny_model)
    assert memory["loss"].settings.chunked and not memory["liger"].active
    assert memory["loss"].reason.endswith(f"Liger's fused linear cross-entropy not used: {memory['liger'].reason}")
    assert "CUDA" in memory["liger"].reason  # why not on this CPU


@pytest.mark.parametrize("other, text", [
    (Decision("fsdp", True, "full_shard", "r"), "not combined with FSDP"),
    (Decision("compile", True, "inductor", "r", settings=type("S", (), {"regions": "blocks+head"})()),
     "compile.regions = 'blocks+head' compiles the stock lm_head and loss"),
])
def test_fallbacks_are_reported(other, text):
    d = loss_feature.decide(plan_ctx(**{other.feature: other}))
    assert not d.active and text in d.reason and d.fallbacks and text in d.fallbacks[0]


def test_set_by_the_memory_budget_says_so():
    from types import SimpleNamespace

    budget = SimpleNamespace(changes=(("checkpointing.enabled", True), ("loss.chunked", True)))
    memory = Decision("memory", None, "budget 1 GiB: fitted", "r", settings=SimpleNamespace(budget=budget))
    d = loss_feature.decide(plan_ctx(memory=memory))
    assert d.active and d.reason.startswith("set by memory.budget (see the memory entry); lm_head + cross-entropy")
    assert not loss_feature.decide(plan_ctx()).reason.startswith("set by")


def test_liger_feature_does_the_job_where_it_is_on():
    from hf_speedup.features.liger import Settings as LigerSettings

    liger = Decision("liger", "auto", "rms_norm,rope,swiglu,fused_linear_cross_entropy", "r",
                     settings=LigerSettings(enabled=True, loss_by="liger"))
    d = loss_feature.decide(plan_ctx(CUDA_H100, liger=liger))
    assert not d.active and "Liger's fused linear cross-entropy (liger feature)" in d.reason and not d.fallbacks
    # Liger on without its loss (a user's liger_kernel_config): the chunked loss does the job
    layers_only = Decision("liger", "auto", "rms_norm,rope", "r", settings=LigerSettings(enabled=True))
    assert loss_feature.decide(plan_ctx(CUDA_H100, liger=layers_only)).active


@pytest.mark.parametrize("field, value, message", [
    ("chunked", "yes", r"loss.chunked = 'yes' is not allowed; allowed: 'auto', True, False"),
    ("chunk_tokens", 0, r"loss.chunk_tokens = 0 is not allowed; allowed: an integer >= 1"),
    ("scaling", "mean", r"loss.scaling = 'mean' is not allowed; allowed: 'auto', 'stock'"),
])
def test_bad_loss_config_names_the_field(field, value, message):
    with pytest.raises(SpeedupConfigError, match=message):
        SpeedupConfig.from_dict({"loss": {field: value}})


# ------------------------------------------------------------------------------------------ trainer
def train(make_args, dataset, collator, speedup=None, **kw):
    from transformers import Trainer

    from hf_speedup import SpeedupTrainer

    # SGD: the weights move by the gradients themselves (Adam would amplify fp32 rounding of near-zero ones)
    args = make_args(max_steps=2, per_device_train_batch_size=2, gradient_accumulation_steps=2, optim="sgd",
                     learning_rate=0.5, lr_scheduler_type="constant", **kw)
    model = small_llama()
    common = dict(model=model, args=args, train_dataset=dataset, data_collator=collator)
    trainer = Trainer(**common) if speedup is None else SpeedupTrainer(**common, speedup=speedup)
    trainer.train()
    return trainer


def test_trainer_with_gradient_accumulation_matches_the_stock_trainer(make_args, tokenizer, collator):
    """Variable-length padded rows and 2 micro-batches per step: the stock Trainer passes num_items_in_batch;
    losses and weights after two steps equal the stock Trainer's (fp32)."""
    from hf_speedup.tiny import make_dataset

    data = make_dataset(tokenizer, n=64, seed=1)  # unpacked: rows of different lengths, padded per batch
    stock = train(make_args, data, collator)
    chunked = train(make_args, data, collator, {"base": "baseline", "loss": {"chunked": True, "chunk_tokens": 16}})
    state = chunked.speedup_status["loss"]
    assert state.engaged, state.engaged_reason
    assert "4 training forward(s) took it" in state.engaged_reason
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (stock, chunked)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for (name, a), b in zip(stock.model.named_parameters(), chunked.model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6, msg=name)


def test_memory_preset_engages_on_the_live_model(make_args, dataset, collator):
    from hf_speedup import SpeedupTrainer

    trainer = SpeedupTrainer(model=small_llama(), args=make_args(max_steps=1), train_dataset=dataset,
                             data_collator=collator, speedup="memory")
    state = trainer.speedup_status["loss"]
    assert state.engaged, state.engaged_reason
    assert "a probe forward with labels took it (logits None) and matched the stock loss" in state.engaged_reason
    assert installed_state(trainer.model) is not None
    assert trainer.model_accepts_loss_kwargs  # the Trainer still passes num_items_in_batch


def tanh_logits_llama():
    """A causal LM that transforms its logits between lm_head and the loss (no config flag says so)."""
    from transformers import LlamaForCausalLM
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class TanhLogits(LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, **kwargs):
            hidden = self.model(input_ids=input_ids).last_hidden_state
            logits = torch.tanh(self.lm_head(hidden))
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs) \
                if labels is not None else None
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    return TanhLogits(small_llama().config)


def test_probe_that_disagrees_uninstalls_and_reports(make_args, dataset, collator):
    """The probe sees the chunked loss differ, puts the stock loss back and reports it."""
    from hf_speedup import SpeedupTrainer

    model = tanh_logits_llama()
    trainer = SpeedupTrainer(model=model, args=make_args(max_steps=1), train_dataset=dataset, data_collator=collator,
                             speedup={"base": "baseline", "loss": {"chunked": True}})
    state = trainer.speedup_status["loss"]
    assert not state.engaged and state.engaged_reason.startswith("MISMATCH: chunked loss")
    assert "uninstalled, the stock loss is back" in state.fallbacks[-1]
    assert installed_state(model) is None and "forward" not in vars(model)


def test_lora_model_takes_the_chunked_path_under_peft(make_args, dataset, collator):
    """peft wraps the model first (LoRA is applied before the loss); the chunked loss sits on the base model."""
    from hf_speedup import SpeedupTrainer

    trainer = SpeedupTrainer(model=small_llama(), args=make_args(max_steps=2), train_dataset=dataset,
                             data_collator=collator, speedup={"base": "lora", "loss": {"chunked": True}})
    assert type(trainer.model).__name__.startswith("Peft")
    trainer.train()
    state = trainer.speedup_status["loss"]
    assert state.engaged and "2 training forward(s) took it" in state.engaged_reason, state.engaged_reason
    assert installed_state(trainer.model).head.weight.grad is None  # frozen head: no weight gradient computed


def test_a_probe_that_fails_is_not_taken_for_success(monkeypatch):
    """The chunked path could not be compared with the stock loss: not engaged, uninstalled, reported."""
    from types import SimpleNamespace

    from hf_speedup.plan_types import Outcome

    model = small_llama()
    decision = plan_for("memory", caps=fake_caps(**CPU_NO_BF16), model=model)["loss"]
    assert decision.settings.chunked
    install(model, decision.settings.chunk_tokens)

    def broken(*a, **k):
        raise RuntimeError("shape '[-1, 32000]' is invalid for input of size 61440")

    monkeypatch.setattr(loss_feature, "probe", broken)
    outcome = Outcome()
    trainer = SimpleNamespace(model=model, state=SimpleNamespace(global_step=0), args=SimpleNamespace(world_size=1))
    engaged, why = loss_feature.verify(decision, trainer, outcome)
    assert not engaged and why.startswith("a probe forward with labels failed (RuntimeError: shape")
    assert installed_state(model) is None and outcome.fallbacks == [f"chunked: {why}"]


def test_uninstall_keeps_a_forward_another_library_put_on_top():
    """TRL wraps the model's forward after hf_speedup did: taking the chunked loss out must not take TRL's."""
    from types import MethodType

    model = small_llama()
    head = model.get_output_embeddings()
    install(model, 64)
    theirs = MethodType(lambda self, *a, **k: "theirs", model)
    model.forward = theirs
    assert uninstall(model)
    assert vars(model)["forward"] is theirs and "forward" not in vars(head)


def test_steps_that_bypass_the_chunked_loss_are_caught_and_a_resume_is_not_taken_for_them():
    """A trainer that computes its loss another way never calls the chunked forward: after steps in train() it
    is not engaged. A resumed run enters train() at the checkpoint's step with no forward yet: that is not it."""
    from types import SimpleNamespace

    from hf_speedup.plan_types import Outcome

    model = small_llama()
    decision = plan_for("memory", caps=fake_caps(**CPU_NO_BF16), model=model)["loss"]
    install(model, decision.settings.chunk_tokens)
    outcome = Outcome()
    trainer = SimpleNamespace(model=model, state=SimpleNamespace(global_step=0), args=SimpleNamespace(world_size=1),
                              is_in_train=False)
    assert loss_feature.verify(decision, trainer, outcome)[0]  # built: nothing has run yet
    trainer.is_in_train, trainer.state.global_step = True, 10  # train() resumed from checkpoint-10
    engaged, why = loss_feature.verify(decision, trainer, outcome)
    assert engaged and "none of" not in why, why
    trainer.state.global_step = 14  # four steps, none through the chunked forward
    engaged, why = loss_feature.verify(decision, trainer, outcome)
    assert not engaged and "but none of 4 training steps took it" in why


def test_a_withdrawn_loss_never_reads_as_applied_in_the_final_report(make_args, dataset, collator):
    """Planned, then taken out by its check forward: after training the report says withdrawn, and why."""
    from hf_speedup import SpeedupTrainer

    trainer = SpeedupTrainer(model=tanh_logits_llama(), args=make_args(max_steps=2), train_dataset=dataset,
                             data_collator=collator, speedup={"base": "baseline", "loss": {"chunked": True}})
    trainer.train()
    entry = trainer.speedup_report.to_dict()["plan"]["loss"]
    assert (entry["applied"], entry["engaged"]) == ("withdrawn", False)
    assert "verified: withdrawn after planning: MISMATCH: chunked loss" in entry["reason"]
    assert entry["settings"]["withdrawn"].endswith("uninstalled, the stock loss is back")


def test_a_loss_that_cannot_be_installed_reads_as_withdrawn(make_args, dataset, collator):
    """Planned for a causal LM whose head apply then finds it cannot serve (a head that is not nn.Linear)."""
    from hf_speedup import SpeedupTrainer

    model = small_llama()
    model.lm_head = torch.nn.Sequential(model.lm_head)
    trainer = SpeedupTrainer(model=model, args=make_args(max_steps=1), train_dataset=dataset, data_collator=collator,
                             speedup={"base": "baseline", "loss": {"chunked": True}})
    entry = trainer.speedup_report.to_dict()["plan"]["loss"]
    assert (entry["applied"], entry["engaged"]) == ("withdrawn", False)
    assert "withdrawn after planning: not installed: the output head is Sequential" in entry["reason"]


@pytest.mark.parametrize("head", ["BertForMaskedLM", "LlamaForSequenceClassification"])
def test_planned_only_for_a_causal_lm_head(head):
    """The chunked loss replaces a causal LM's lm_head and shifted cross-entropy: elsewhere it is not applicable
    (not a fallback), said up front."""
    import transformers

    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=64)
    config = (transformers.BertConfig(**sizes) if head.startswith("Bert") else
              transformers.LlamaConfig(**sizes, num_labels=3, pad_token_id=0))
    model = getattr(transformers, head)(config)
    d = plan_for("memory", caps=fake_caps(**CPU_NO_BF16), model=model)["loss"]
    assert d.applied == "off" and d.fallbacks == ()
    kind = "a masked-LM head" if head.startswith("Bert") else "a sequence-classification head"
    assert d.reason.startswith(f"not applicable: {head} has {kind}; the chunked loss replaces a causal LM's lm_head "
                               "and shifted cross-entropy (the stock loss is kept)")


# ------------------------------------------------------------------------------- scaling of own-mean heads
@pytest.mark.parametrize("cls, own_mean", [
    ("LlamaForCausalLM", False), ("MixtralForCausalLM", False), ("GPT2LMHeadModel", False),
    ("ModernBertForMaskedLM", False), ("LlamaForQuestionAnswering", False),  # their loss takes **kwargs
    ("LlamaForSequenceClassification", True), ("LlamaForTokenClassification", True), ("BertForMaskedLM", True),
    ("BertForSequenceClassification", True), ("T5ForConditionalGeneration", True),
])
def test_heads_whose_loss_is_their_own_mean_are_read_from_transformers_code(cls, own_mean):
    import transformers

    from hf_speedup.model_parts import loss_takes_own_mean

    model = getattr(transformers, cls).__new__(getattr(transformers, cls))  # the class's code is what is read
    assert bool(loss_takes_own_mean(model)) is own_mean


def test_models_that_declare_it_or_are_not_transformers_code_keep_the_trainers_rule():
    import transformers

    from hf_speedup.model_parts import loss_takes_own_mean

    class Declared(transformers.BertForSequenceClassification):
        accepts_loss_kwargs = True

    class Custom(torch.nn.Module):
        def forward(self, x, labels=None, **kwargs):
            return torch.nn.functional.mse_loss(x, labels)

    assert loss_takes_own_mean(Declared.__new__(Declared)) == ""
    assert loss_takes_own_mean(Custom()) == ""  # what its **kwargs feed cannot be told: the Trainer's rule stays


def _classifier_step(make_args, speedup, batch_size, accumulation):
    """One SGD step of a tiny BERT classifier on 4 rows; (logged loss, size of the weight update)."""
    import transformers
    from datasets import Dataset

    from hf_speedup import SpeedupTrainer

    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     vocab_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0, num_labels=3)
    model = transformers.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(1)
    rows = Dataset.from_list([{"input_ids": torch.randint(3, 64, (10,), generator=g).tolist(), "labels": i % 3}
                              for i in range(4)])
    args = make_args(max_steps=1, per_device_train_batch_size=batch_size, gradient_accumulation_steps=accumulation,
                     optim="sgd", learning_rate=0.1, lr_scheduler_type="constant", max_grad_norm=0)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = SpeedupTrainer(model=model, args=args, train_dataset=rows,
                             speedup={"base": speedup, "precision": {"dtype": "fp32"}})
    loss = trainer.train().training_loss
    moved = sum((p.detach() - b).norm() ** 2 for p, b in zip(model.parameters(), before)) ** 0.5
    return trainer, loss, float(moved)


def test_gradient_accumulation_on_a_classifier_gives_the_whole_batchs_loss_and_update(make_args):
    """The stock Trainer skips the division by gradient_accumulation_steps for a forward(**kwargs) whose loss is
    its own mean: ``baseline`` (the stock Trainer) trains on twice the loss at 2 micro-batches; ``auto`` on the
    whole batch's."""
    _, whole, whole_update = _classifier_step(make_args, "auto", 4, 1)
    trainer, loss, update = _classifier_step(make_args, "auto", 2, 2)
    assert loss == pytest.approx(whole, rel=1e-5) and update == pytest.approx(whole_update, rel=1e-4)
    assert trainer.model_accepts_loss_kwargs is False
    entry = trainer.speedup_report.to_dict()["plan"]["loss"]
    assert "BertForSequenceClassification's loss is its own mean" in entry["reason"]
    assert entry["reason"].endswith("verified: trainer.model_accepts_loss_kwargs = False (the Trainer's token-count "
                                    "scaling turned off)")
    stock, loss, update = _classifier_step(make_args, "baseline", 2, 2)
    assert stock.model_accepts_loss_kwargs is True  # baseline is the stock Trainer, its scaling included
    assert loss == pytest.approx(2 * whole, rel=1e-5) and update == pytest.approx(2 * whole_update, rel=1e-4)


def test_a_causal_lm_keeps_the_trainers_token_count_scaling(make_args, dataset, collator):
    trainer = train(make_args, dataset, collator, speedup={"base": "auto", "precision": {"dtype": "fp32"}})
    assert trainer.model_accepts_loss_kwargs is True
    assert "token-count scaling" not in trainer.speedup_report.to_dict()["plan"]["loss"]["reason"]
