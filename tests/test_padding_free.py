"""Padding-free batches: exact per-sequence math, the use_cache trap closed on every path, exact token counts,
and a bounded number of recompiles under compile on ragged data."""

from __future__ import annotations

import math
import random

import pytest
import torch

from conftest import CPU_NO_BF16, fake_caps
from hf_speedup import SpeedupTrainer, plan_for, get_preset
from hf_speedup.features import data
from hf_speedup.features.data import padding_free as pf

LENGTHS = [5, 17, 3, 29, 11, 8]


def examples(lengths=LENGTHS, seed=0, vocab=40):
    rng = random.Random(seed)
    return [{"input_ids": [1] + [rng.randrange(4, vocab) for _ in range(n - 1)]} for n in lengths]


def ragged(n: int, lo: int = 16, hi: int = 512, seed: int = 0, vocab: int = 512):
    """Rows with lengths log-uniform in [lo, hi] (the issue's ragged data)."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        length = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        rows.append([1] + [rng.randrange(4, vocab) for _ in range(length - 1)])
    return Dataset.from_dict({"input_ids": rows})


def model_with(impl: str, **sizes):
    from hf_speedup.features.attention import sdpa_varlen
    from hf_speedup.tiny import tiny_llama

    sdpa_varlen.register()
    model = tiny_llama(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       **sizes)
    model.set_attn_implementation(impl)
    model.config.use_cache = False
    return model.eval()


def per_sequence(flat_logits, lengths):
    out, start = [], 0
    for n in lengths:
        out.append(flat_logits[0, start:start + n])
        start += n
    return out


# ------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("impl", ["sdpa", "eager", "sdpa_varlen"])
def test_logits_and_loss_equal_the_padded_batch_per_sequence(impl, collator):
    feats = examples()
    flat_collator, note = pf.flattening_collator(collator, None)
    assert isinstance(flat_collator, pf.PaddingFreeCollator) and "DataCollatorForLanguageModeling" in note
    flat, padded = flat_collator(feats), collator(feats)
    assert flat["input_ids"].shape == (1, sum(LENGTHS)) and "attention_mask" not in flat
    model = model_with(impl)
    with torch.no_grad():
        out_flat, out_pad = model(**flat), model(**padded)
    for i, (got, n) in enumerate(zip(per_sequence(out_flat.logits, LENGTHS), LENGTHS)):
        torch.testing.assert_close(got, out_pad.logits[i, :n], rtol=1e-5, atol=1e-5, msg=f"sequence {i}")
    torch.testing.assert_close(out_flat.loss, out_pad.loss, rtol=1e-6, atol=1e-6)


def test_sliding_window_models_get_a_kernel_that_keeps_the_window(collator, make_args):
    """Mistral-style sliding windows: sdpa_varlen would attend past the window, so the plan takes sdpa (the
    mask transformers builds keeps both the window and the sequences apart); packed logits = padded ones."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                                             pad_token_id=0, attn_implementation="sdpa")).eval()
    model.config.use_cache = False
    d = plan_for("auto", caps=fake_caps(**CPU_NO_BF16), model=model, args=make_args())["attention"]
    assert d.settings.implementation == "sdpa", d.reason
    assert "sdpa_varlen: MistralForCausalLM attends within a sliding window of 4 tokens" in d.reason

    feats = examples()
    flat = pf.flattening_collator(collator, None)[0](feats)
    with torch.no_grad():
        out_flat, out_pad = model(**flat), model(**collator(feats))
    for i, (got, n) in enumerate(zip(per_sequence(out_flat.logits, LENGTHS), LENGTHS)):
        torch.testing.assert_close(got, out_pad.logits[i, :n], rtol=1e-5, atol=1e-5, msg=f"sequence {i}")



def test_latent_attention_models_keep_sdpa_and_stay_exact_when_forced(collator, make_args, caplog):
    """DeepSeek V3's latent attention: 24-wide queries and keys over 16-wide values, which torch's CPU flash kernel
    refuses ("Q/K/V should have the same head size"). The plan takes sdpa with the reason; a model switched to
    sdpa_varlen by hand runs through sdpa's masked path, said once, and its packed logits equal the padded ones."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from hf_speedup.features.attention import sdpa_varlen

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=40, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, pad_token_id=0, attn_implementation="sdpa")).eval()
    model.config.use_cache = False
    d = plan_for("auto", caps=fake_caps(**CPU_NO_BF16), model=model, args=make_args())["attention"]
    assert d.settings.implementation == "sdpa", d.reason
    assert "DeepseekV3ForCausalLM's values are 16 wide, narrower than its queries and keys" in d.reason
    sdpa_varlen.register()
    model.set_attn_implementation("sdpa_varlen")
    feats = examples()
    flat = pf.flattening_collator(collator, None)[0](feats)
    sdpa_varlen._WARNED.clear()
    with torch.no_grad(), caplog.at_level("WARNING", logger="hf_speedup"):
        out_flat, out_pad = model(**flat), model(**collator(feats))
    assert sum("16-wide values under 24-wide queries" in r.message for r in caplog.records) == 1
    for i, (got, n) in enumerate(zip(per_sequence(out_flat.logits, LENGTHS), LENGTHS)):
        torch.testing.assert_close(got, out_pad.logits[i, :n], rtol=1e-5, atol=1e-5, msg=f"sequence {i}")

@pytest.mark.parametrize("impl", ["sdpa", "sdpa_varlen"])
def test_perturbing_one_sequence_moves_only_its_own_logits(impl):
    feats = examples()
    changed = [dict(f) for f in feats]
    changed[2] = {"input_ids": [1] + [7] * (LENGTHS[2] - 1)}
    collate = pf.PaddingFreeCollator("input_ids")
    model = model_with(impl)
    with torch.no_grad():
        before = per_sequence(model(**collate(feats)).logits, LENGTHS)
        after = per_sequence(model(**collate(changed)).logits, LENGTHS)
    for i in range(len(LENGTHS)):
        if i == 2:
            assert (after[i] - before[i]).abs().max() > 1e-3  # the perturbed sequence does change
        else:
            torch.testing.assert_close(after[i], before[i], rtol=0, atol=1e-6, msg=f"sequence {i} moved")


def test_sdpa_varlen_under_bf16_autocast_matches_sdpa_in_the_same_dtype(collator):
    """CPU with AMX trains in bf16 autocast: RoPE leaves q, k in fp32 and v in bf16; the kernel casts as sdpa does."""
    from conftest import assert_same_in_dtype

    feats = examples()
    flat = pf.PaddingFreeCollator("input_ids")(feats)
    varlen, sdpa = model_with("sdpa_varlen"), model_with("sdpa")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = varlen(**flat).logits, sdpa(**flat).logits
    assert_same_in_dtype(got, want, "bf16", "logits")


def test_sdpa_varlen_gradients_equal_the_masked_kernel():
    from hf_speedup.features.attention.sdpa_varlen import packed_causal_mask

    torch.manual_seed(0)
    lengths = [7, 30, 2, 45]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    q, k, v = (torch.randn(1, 4, sum(lengths), 16, requires_grad=True) for _ in range(3))
    out, _ = torch.ops.hf_speedup.sdpa_varlen(q, k, v, pos, 0.25)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=packed_causal_mask(pos), scale=0.25)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)



def test_sdpa_varlen_takes_grouped_keys_as_they_are_and_keeps_only_them_for_backward():
    """Grouped-query attention (SmolLM2: 9 query heads on 3 key/value heads): torch's CPU kernel reads the shared
    heads itself, so the keys and values are not repeated per query head; the op keeps the un-repeated ones for
    backward (the memory model counts kv width), with gradients equal to the masked kernel's. Inputs in the
    layout the models pass them: (B, H, T, D) views of (B, T, H, D) projections."""
    from types import SimpleNamespace

    from hf_speedup.features.attention import sdpa_varlen

    if not sdpa_varlen.native_gqa():
        pytest.skip("this torch's CPU flash kernel wants equal head counts (keys are repeated)")
    torch.manual_seed(0)
    lengths = [7, 30, 2, 45]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    t = sum(lengths)
    q = torch.randn(1, t, 4, 16).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(1, t, 2, 16).transpose(1, 2).requires_grad_() for _ in range(2))
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        out, _ = sdpa_varlen.attention_forward(module, q, k, v, None, scaling=0.25, position_ids=pos)
    assert (1, 4, t, 16) not in saved[1:3] and saved[1:3] == [(1, 2, t, 16), (1, 2, t, 16)], saved
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_varlen.packed_causal_mask(pos),
                                                           scale=0.25, enable_gqa=True).transpose(1, 2)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_grouped_sdpa_varlen_compiles_whole_and_its_fake_matches_the_op():
    """The grouped-heads probe runs at registration, outside any trace (inside, its tensor checks broke a fullgraph
    compile); the backward op's fake outputs have the real op's shapes and strides (opcheck)."""
    from types import SimpleNamespace

    from torch._dynamo.testing import CompileCounter

    from hf_speedup.features.attention import sdpa_varlen

    sdpa_varlen._GQA.clear()
    sdpa_varlen.register()
    assert "cpu" in sdpa_varlen._GQA
    module = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    counter = CompileCounter()
    fn = torch.compile(lambda q, k, v, p: sdpa_varlen.attention_forward(module, q, k, v, None, scaling=0.25,
                                                                       position_ids=p)[0].sum(),
                       backend=counter, fullgraph=True, dynamic=True)
    pos = torch.cat([torch.arange(n) for n in (5, 9)])[None]
    q = torch.randn(1, 14, 4, 8).transpose(1, 2)
    k, v = (torch.randn(1, 14, 2, 8).transpose(1, 2) for _ in range(2))
    fn(q, k, v, pos)
    assert counter.frame_count == 1
    out, lse = torch.ops.hf_speedup.sdpa_varlen(q, k, v, pos, 0.25)
    torch.library.opcheck(torch.ops.hf_speedup.sdpa_varlen_backward.default,
                          (torch.randn_like(out), q, k, v, out, lse, pos, 0.25), test_utils=("test_faketensor",))

def test_sdpa_varlen_compiles_into_one_graph_for_every_row_length():
    """An opaque op: no graph break, no data-dependent shape; new lengths and sequence counts do not recompile."""
    from torch._dynamo.testing import CompileCounter

    from hf_speedup.features.attention import sdpa_varlen

    counter = CompileCounter()
    fn = torch.compile(lambda q, k, v, p: torch.ops.hf_speedup.sdpa_varlen(q, k, v, p, 0.25)[0].sum(),
                       backend=counter, fullgraph=True, dynamic=True)
    for lengths in ([3, 9], [20, 1, 4], [50]):
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        q = torch.randn(1, 2, sum(lengths), 8)
        fn(q, q, q, pos)
    assert counter.frame_count == 1
    assert sdpa_varlen.sequence_bounds(torch.tensor([[0, 1, 2, 0, 1, 0]])) == [[0, 3, 5, 6]]


# ------------------------------------------------------------------------------------------ collators
def test_collator_conversions_keep_the_replaced_collators_labels(tokenizer):
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding, default_data_collator

    feats = [{"input_ids": [1, 5, 6, 0], "attention_mask": [1, 1, 1, 0]}, {"input_ids": [1, 7]}]
    lm, _ = pf.flattening_collator(DataCollatorForLanguageModeling(tokenizer, mlm=False), None)
    batch = lm(feats)  # pre-padded example stripped to its real tokens
    assert batch["input_ids"].tolist() == [[1, 5, 6, 1, 7]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 5, 6, -100, 7]]
    for given in (None, DataCollatorWithPadding(tokenizer), default_data_collator):
        new, note = pf.flattening_collator(given, tokenizer)
        assert isinstance(new, pf.PaddingFreeCollator), note
        assert "labels" not in new([{"input_ids": [1, 5]}, {"input_ids": [1]}])  # none made, as before
        assert new([{"input_ids": [1, 5], "labels": [1, 5]}])["labels"].tolist() == [[-100, 5]]


def test_collators_that_cannot_be_flattened_say_why(tokenizer):
    from transformers import DataCollatorForLanguageModeling

    assert pf.flattening_collator(None, tokenizer, trainer_builds_collator=True)[0] is None
    masked = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    masked.mlm = True  # (the char tokenizer has no mask token to build one with)
    new, why = pf.flattening_collator(masked, None)
    assert new is None and "masked-LM" in why
    new, why = pf.flattening_collator(lambda rows: rows, None)
    assert new is None and why.startswith("function is not a collator hf_speedup knows how to flatten")


# ------------------------------------------------------------------------------------------ plan
def test_auto_and_fast_plan_padding_free_and_baseline_does_not(tiny_model, make_args):
    args = make_args(per_device_train_batch_size=8)
    for preset in ("auto", "fast"):
        d = plan_for(preset, caps=fake_caps(**CPU_NO_BF16), model=tiny_model, args=args)["data"]
        assert d.settings.padding_free and d.settings.padding_free_via == "collator", preset
    assert not plan_for("baseline", caps=fake_caps(**CPU_NO_BF16), model=tiny_model, args=args)["data"].settings.padding_free


def test_models_without_packed_sequence_support_keep_padding(make_args):
    from hf_speedup.model_info import describe_model

    info = describe_model(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    cfg = get_preset("baseline").replace(data={"padding_free": True})
    d = plan_for(cfg, caps=fake_caps(**CPU_NO_BF16), model=info, args=make_args())["data"]
    assert not d.settings.padding_free
    assert d.fallbacks[0].startswith("padding_free: Sequential is not a decoder-only model")
    auto = plan_for(cfg.replace(data={"padding_free": "auto"}), caps=fake_caps(**CPU_NO_BF16), model=info)["data"]
    assert not auto.settings.padding_free and auto.fallbacks == ()  # auto: a reason, not a fallback


def test_encoders_and_non_lm_heads_keep_padding_in_auto(make_args):
    """Packed rows are only safe for a causal LM: an encoder's attention sees the whole row, and a
    classification head's labels are one per row, not per token."""
    from transformers import (BertConfig, BertForMaskedLM, BertForSequenceClassification, LlamaConfig,
                              LlamaForCausalLM, LlamaForSequenceClassification)

    bert = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    llama = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, pad_token_id=0)
    cases = {BertForMaskedLM(bert): "is not a decoder-only model",
             BertForSequenceClassification(bert): "is not a decoder-only model",
             LlamaForSequenceClassification(llama): "has no causal-LM head"}
    for model, why in cases.items():
        d = plan_for("auto", caps=fake_caps(**CPU_NO_BF16), model=model, args=make_args())["data"]
        assert not d.settings.padding_free and why in d.reason, (type(model).__name__, d.reason)
    d = plan_for("auto", caps=fake_caps(**CPU_NO_BF16), model=LlamaForCausalLM(llama), args=make_args())["data"]
    assert d.settings.padding_free  # the control: the same body with an LM head packs


def test_batch_of_one_has_nothing_to_unpad(tiny_model, make_args):
    d = plan_for("auto", caps=fake_caps(**CPU_NO_BF16), model=tiny_model,
                   args=make_args(per_device_train_batch_size=1))["data"]
    assert not d.settings.padding_free and "one sequence per batch" in d.reason


def test_compile_under_padding_free_has_a_dynamic_sequence_dimension(tiny_model, make_args):
    plan = plan_for("fast", caps=fake_caps(**CPU_NO_BF16), model=tiny_model, args=make_args())
    assert get_preset("fast").compile.dynamic is False
    assert plan["compile"].settings.dynamic is True and plan["compile"].settings.cpu_gemm == "default"
    assert "sequence dimension is compiled dynamic (dynamic=False asked)" in plan["compile"].reason
    padded = plan_for(get_preset("fast").replace(data={"padding_free": False}), caps=fake_caps(**CPU_NO_BF16),
                        model=tiny_model, args=make_args())
    assert padded["compile"].settings.dynamic is False
    trl = pytest.importorskip("trl")  # rows TRL flattens itself (packing) change length every step just the same
    packed = plan_for(get_preset("fast").replace(data={"padding_free": False}), caps=fake_caps(**CPU_NO_BF16),
                        model=tiny_model, args=trl.SFTConfig(output_dir="unused", packing=True, use_cpu=True,
                                                             bf16=False, report_to=[]))
    assert packed["data"].settings.rows_flattened and packed["compile"].settings.dynamic is True


# ------------------------------------------------------------------------------------------ the trainer
def _trainer(tiny_model, make_args, dataset, collator, speedup="fast", **args):
    cfg = get_preset(speedup).replace(compile={"backend": "eager"}) if isinstance(speedup, str) else speedup
    return SpeedupTrainer(model=tiny_model, args=make_args(**args), train_dataset=dataset, eval_dataset=dataset,
                          data_collator=collator, speedup=cfg)


def test_use_cache_trap_is_closed_on_every_path_the_trainer_drives(tiny_model, make_args, collator):
    """With the config's default use_cache=True, a flattened forward builds a cache, transformers skips
    packed-sequence detection and sequences attend to each other; the guard keeps every path exact."""
    from datasets import Dataset

    feats = examples()
    ds = Dataset.from_list(feats)
    cfg = get_preset("fast").replace(compile={"enabled": False}, attention={"implementation": "sdpa"})
    trainer = _trainer(tiny_model, make_args, ds, collator, speedup=cfg, per_device_train_batch_size=len(feats),
                       per_device_eval_batch_size=len(feats))
    assert trainer.speedup_status["data"].engaged, trainer.speedup_status["data"].engaged_reason
    model = trainer.model.eval()
    model.config.use_cache = True  # what an unprepared model carries, and what a user may set back
    flat = trainer.data_collator(feats)
    with torch.no_grad():
        reference = model(**collator(feats), use_cache=False).logits
        direct = model(**flat).logits
        loss, logits, _ = trainer.prediction_step(model, trainer._prepare_inputs(dict(flat)), prediction_loss_only=False)
        trained_loss = trainer.compute_loss(model, dict(flat))
        unguarded = model_with("sdpa")
        unguarded.load_state_dict(model.state_dict())
        unguarded.config.use_cache = True
        trapped = unguarded(**flat).logits
    for got in (direct, logits):
        for i, (seq, n) in enumerate(zip(per_sequence(got, LENGTHS), LENGTHS)):
            torch.testing.assert_close(seq, reference[i, :n], rtol=1e-5, atol=1e-5, msg=f"sequence {i}")
    torch.testing.assert_close(loss, trained_loss)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(float(trained_loss), rel=1e-5)
    # without the guard the same call is wrong: the test above can fail
    assert max((s - reference[i, :n]).abs().max().item()
               for i, (s, n) in enumerate(zip(per_sequence(trapped, LENGTHS), LENGTHS))) > 0.05


@pytest.mark.parametrize("name", ["cache", "past_key_values"])  # transformers >= 5.24 says cache
def test_use_cache_guard_leaves_a_call_that_brings_its_own_cache_alone(name):
    from hf_speedup.features.data.padding_free import _no_cache_for_packed_rows

    packed = {"position_ids": torch.tensor([[0, 1, 2, 0, 1]]), "attention_mask": None}
    assert _no_cache_for_packed_rows(None, (), dict(packed))[1]["use_cache"] is False
    assert _no_cache_for_packed_rows(None, (), {**packed, name: object()}) is None  # decoding with a cache


def test_token_counts_are_exact(tiny_model, make_args, collator):
    from datasets import Dataset

    feats = examples([9, 14, 3, 22, 5, 7, 31, 2])
    ds = Dataset.from_list(feats)
    counts = {}
    for name, cfg in (("flat", "fast"), ("padded", get_preset("fast").replace(data={"padding_free": False}))):
        trainer = _trainer(tiny_model, make_args, ds, collator, speedup=cfg, per_device_train_batch_size=4,
                           max_steps=2)
        trainer.train()
        x = trainer.speedup_report.to_dict()["measurement"]
        counts[name] = [x[k] for k in ("tokens", "samples", "attention_sequence_length", "flops_per_token")]
    lengths = [len(f["input_ids"]) for f in feats]
    # the same sequences whether flattened or padded: tokens, samples, attention's length and so the FLOPs
    assert counts["flat"] == counts["padded"]
    assert counts["flat"][:3] == [sum(lengths), 8, pytest.approx(sum(n * n for n in lengths) / sum(lengths))]


@pytest.mark.slow  # 230 steps: ~1 min on 2 idle cores
def test_recompiles_stay_bounded_over_200_ragged_steps(make_args, collator):
    """Ragged rows (log-uniform 16-512, batch 8): the dynamic sequence dimension compiles once; the padded
    static-shape run it replaces recompiles for each new padded length (the control shows the bound bites).
    Dynamo's guards decide recompiles, whatever the backend: the eager backend keeps the test cheap."""
    from hf_speedup.tiny import tiny_llama

    ds = ragged(400)
    runs = {}
    for name, cfg, steps in (
        ("padding_free", get_preset("fast").replace(compile={"backend": "eager", "when": "always"}), 200),
        ("padded_static", get_preset("fast").replace(compile={"backend": "eager", "when": "always"},
                                                     data={"padding_free": False}), 30),
    ):
        torch._dynamo.reset()
        model = tiny_llama(seed=0, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2)
        trainer = SpeedupTrainer(model=model, args=make_args(per_device_train_batch_size=8, max_steps=steps,
                                                             logging_steps=50),
                                 train_dataset=ds, data_collator=collator, speedup=cfg)
        trainer.train()
        runs[name] = trainer.speedup_report.to_dict()
    pf_run = runs["padding_free"]
    assert pf_run["measurement"]["steps"] == 200
    assert pf_run["metrics"]["recompiles"] <= 2, pf_run["metrics"]
    assert pf_run["plan"]["compile"]["engaged"] and pf_run["plan"]["data"]["engaged"]
    assert runs["padded_static"]["metrics"]["recompiles"] > 2  # the bound is not trivially met


def test_a_collator_subclass_is_not_flattened_behind_its_back(tokenizer):
    """A subclass may mask prompt labels in its own torch_call: flattening it as its base would train on them."""
    from transformers import DataCollatorForLanguageModeling

    class CompletionOnly(DataCollatorForLanguageModeling):
        def torch_call(self, examples):
            batch = super().torch_call(examples)
            batch["labels"][:, :2] = -100  # the prompt
            return batch

    new, why = pf.flattening_collator(CompletionOnly(tokenizer, mlm=False), None)
    assert new is None
    assert why.startswith("CompletionOnly subclasses DataCollatorForLanguageModeling: it may make its labels")


def test_labels_under_another_name_are_kept_and_mixed_labels_are_one_clear_error():
    collate = pf.PaddingFreeCollator("features")
    batch = collate([{"input_ids": [1, 5, 6], "label_ids": [1, 5, 6]}, {"input_ids": [1, 7], "label_ids": [-100, 7]}])
    assert batch["labels"].tolist() == [[-100, 5, 6, -100, 7]]
    with pytest.raises(ValueError, match=r"some examples carry 'labels' and others do not; fix: give every example"):
        collate([{"input_ids": [1, 5], "labels": [1, 5]}, {"input_ids": [1, 7]}])


# ------------------------------------------------------------------------------------------ prepared labels
def test_prepared_labels_and_loss_masks_survive_the_causal_lm_conversion(tokenizer):
    """DataCollatorForLanguageModeling(mlm=False) as a flattening collator keeps the labels a trainer prepared
    (completion-only: the prompt at -100) and applies TRL's loss-mask columns where there are no labels."""
    from transformers import DataCollatorForLanguageModeling

    flat, _ = pf.flattening_collator(DataCollatorForLanguageModeling(tokenizer, mlm=False), None)
    prepared = [{"input_ids": [1, 5, 6, 7], "labels": [-100, -100, 6, 7]},
                {"input_ids": [1, 8, 9], "labels": [-100, -100, 9]}]
    assert flat(prepared)["labels"].tolist() == [[-100, -100, 6, 7, -100, -100, 9]]
    masked = [{"input_ids": [1, 5, 6, 7], "completion_mask": [0, 0, 1, 1]},
              {"input_ids": [1, 8, 9], "assistant_masks": [0, 1, 1]},
              {"input_ids": [1, 4, 0, 3], "attention_mask": [1, 1, 0, 0], "completion_mask": [0, 1, 0, 0]}]
    assert flat(masked)["labels"].tolist() == [[-100, -100, 6, 7, -100, 8, 9, -100, 4]]
    assert flat([{"input_ids": [1, 5, 6]}])["labels"].tolist() == [[-100, 5, 6]]  # none given: the ids, as before
    with pytest.raises(ValueError, match="completion_mask is not as long as its input_ids"):
        flat([{"input_ids": [1, 5, 6], "completion_mask": [0, 1]}])


def test_completion_only_loss_through_sft_trainer_trains_only_the_completions(tmp_path):
    """Prompt-completion data, the user's transformers DataCollatorForLanguageModeling: TRL builds the labels
    (prompt at -100); the flattened batch trains exactly the tokens TRL's own padding-free collator would."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling as TrlCollator

    from hf_speedup import SpeedupSFTTrainer
    from hf_speedup.tiny import chat_tokenizer, tiny_llama

    tok = chat_tokenizer()
    rows = Dataset.from_list([{"prompt": f"What is {i} plus {i}? Please answer.", "completion": f" {2 * i}"}
                              for i in range(16)])
    args = trl.SFTConfig(output_dir=str(tmp_path / "o"), per_device_train_batch_size=4, max_steps=1, report_to=[],
                         use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, max_length=None)
    trainer = SpeedupSFTTrainer(model=tiny_llama(seed=0, hidden_size=64, intermediate_size=128,
                                                 num_attention_heads=4, num_key_value_heads=2),
                                args=args, train_dataset=rows, processing_class=tok,
                                data_collator=DataCollatorForLanguageModeling(tok, mlm=False),
                                speedup=get_preset("fast").replace(compile={"backend": "eager"}))
    assert isinstance(trainer.data_collator, pf.PaddingFreeCollator)
    examples = [trainer.train_dataset[i] for i in range(4)]
    completion = [sum(1 for x in e["labels"][1:] if x != -100) for e in examples]  # first positions never train
    assert all(n > 0 for n in completion) and sum(completion) < sum(len(e["input_ids"]) for e in examples) // 2
    got = trainer.data_collator(examples)["labels"]
    want = TrlCollator(pad_token_id=tok.pad_token_id, padding_free=True)(examples)["labels"]
    assert int((got != -100).sum()) == sum(completion)
    assert got.tolist() == want.tolist()


# ------------------------------------------------------------------------------------------ rows TRL flattens
def _padded_reference(model, flat, pad_id):
    """Per-sequence logits of the flattened row's sequences, computed as a padded batch (no cache)."""
    ids, pos = flat["input_ids"][0], flat["position_ids"][0]
    starts = (pos == 0).nonzero().flatten().tolist() + [len(ids)]
    seqs = [ids[a:b] for a, b in zip(starts, starts[1:])]
    longest = max(len(s) for s in seqs)
    batch = torch.full((len(seqs), longest), pad_id)
    mask = torch.zeros_like(batch)
    for i, s in enumerate(seqs):
        batch[i, :len(s)], mask[i, :len(s)] = s, 1
    with torch.no_grad():
        logits = model(input_ids=batch, attention_mask=mask, use_cache=False).logits
    return [logits[i, :len(s)] for i, s in enumerate(seqs)], [len(s) for s in seqs]


@pytest.mark.parametrize("case", ["baseline_padding_free", "fast_packing_no_padding_free"])
def test_rows_the_trl_args_flatten_get_the_use_cache_guard(tmp_path, case):
    """The user's SFTConfig.padding_free (or packing) flattens rows while hf_speedup's plan has padding-free
    off: a direct forward with the config's use_cache=True still keeps the sequences apart."""
    trl = pytest.importorskip("trl")
    from hf_speedup import SpeedupSFTTrainer
    from hf_speedup.tiny import chat_dataset, chat_tokenizer, tiny_llama

    own = {"padding_free": True, "max_length": None} if case == "baseline_padding_free" else {"packing": True,
                                                                                              "max_length": 128}
    speedup = ("baseline" if case == "baseline_padding_free" else
               {"base": "fast", "compile": {"enabled": False}, "data": {"padding_free": False}})
    args = trl.SFTConfig(output_dir=str(tmp_path / "o"), per_device_train_batch_size=4, max_steps=1, report_to=[],
                         use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, **own)
    model = tiny_llama(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    tok = chat_tokenizer()
    trainer = SpeedupSFTTrainer(model=model, args=args, train_dataset=chat_dataset(16, seed=0), processing_class=tok,
                                speedup=speedup)
    assert not trainer.speedup_plan["data"].settings.padding_free  # hf_speedup's own padding-free is off
    flat = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    assert flat["input_ids"].shape[0] == 1 and "attention_mask" not in flat
    model = trainer.model.eval()
    model.config.use_cache = True  # the default of an unprepared model
    with torch.no_grad():
        direct = model(input_ids=flat["input_ids"], position_ids=flat["position_ids"]).logits
    reference, lengths = _padded_reference(model, flat, tok.pad_token_id)
    assert len(lengths) > 1
    for i, (seq, want) in enumerate(zip(per_sequence(direct, lengths), reference)):
        torch.testing.assert_close(seq, want, rtol=1e-5, atol=1e-5, msg=f"sequence {i}")
    assert pf.use_cache_guarded(trainer.model)
    state = trainer.speedup_status["data"]
    assert "flattens: yes" in state.engaged_reason, state.engaged_reason


def test_a_collator_that_cannot_be_flattened_withdraws_the_trainers_padding_free(tmp_path):
    """fast plans SFTConfig.padding_free; the user's own collator cannot be flattened (a fallback): the
    argument is withdrawn too, since TRL refuses padding_free=True beside a custom collator."""
    trl = pytest.importorskip("trl")
    from transformers import DataCollatorForLanguageModeling

    from hf_speedup import SpeedupSFTTrainer
    from hf_speedup.tiny import chat_dataset, chat_tokenizer, tiny_llama

    class Custom(DataCollatorForLanguageModeling):
        pass

    tok = chat_tokenizer()
    args = trl.SFTConfig(output_dir=str(tmp_path / "o"), per_device_train_batch_size=4, max_steps=1, report_to=[],
                         use_cpu=True, bf16=False, save_strategy="no", disable_tqdm=True, max_length=None)
    trainer = SpeedupSFTTrainer(model=tiny_llama(seed=0, hidden_size=64, intermediate_size=128,
                                                 num_attention_heads=4, num_key_value_heads=2),
                                args=args, train_dataset=chat_dataset(16, seed=0), processing_class=tok,
                                data_collator=Custom(tok, mlm=False), speedup=get_preset("fast").replace(
                                    compile={"backend": "eager"}))
    assert type(trainer.data_collator) is Custom and trainer.args.padding_free is False
    state = trainer.speedup_status["data"]
    assert any(f.startswith("padding_free: Custom subclasses DataCollatorForLanguageModeling") for f in state.fallbacks)
