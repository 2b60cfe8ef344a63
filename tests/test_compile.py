"""Regional compile: plan decisions, in-place wiring, eager fallback, recompile counting, LoRA/checkpointing.

Wiring tests use the ``eager``/``aot_eager`` backends (dynamo + AOTAutograd, no C++ build); one slow test
runs inductor for real.
"""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch

from conftest import CPU_NO_BF16, CUDA_H100, fake_caps
from hf_speedup import SpeedupTrainer, plan_for, get_preset
from hf_speedup.features import Setup
from hf_speedup.features import compile as rc
from hf_speedup.features.compile import cpu_gemm as gemm
from hf_speedup.features.compile import install, verification
from hf_speedup.model_info import ModelInfo
from hf_speedup.plan_types import FeatureState, Outcome

TINY_INFO = ModelInfo(architecture="LlamaForCausalLM", block_class="LlamaDecoderLayer", num_blocks=4)


def compile_cfg(**compile):
    return get_preset("baseline").replace(compile={"enabled": True, "backend": "eager", **compile})


def compiled(model, **compile):
    """Plan + apply regional compile on ``model`` (CPU capabilities), returning the decision and its outcome.

    ``use_cache`` off as the Trainer sets it (``args.use_cache``): a KV cache in training makes dynamo
    specialise on each block's ``layer_idx``.
    """
    model.config.use_cache = False
    plan = plan_for(compile_cfg(**compile), fake_caps(**CPU_NO_BF16), model)
    decision, outcome = plan["compile"], Outcome()
    rc.apply(decision, Setup(model=model, args=None), outcome)
    return decision, outcome


def batch(tokenizer, lengths, vocab=64, seed=0):
    """Right-padded causal-LM batch; labels = input_ids with padding ignored."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(4, vocab, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_same_grads(a, b, rtol=1e-4, atol=1e-6):
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with empty dynamo caches and counters (they are process-global)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --------------------------------------------------------------------------------------------- decide
class TestDecide:
    def test_auto_is_on_for_cuda_with_triton(self):
        d = plan_for(get_preset("auto"), fake_caps(**CUDA_H100), TINY_INFO)["compile"]
        assert d.applied == "blocks:inductor"
        assert isinstance(d.settings, rc.Settings)
        assert dataclasses.asdict(d.settings) == {"backend": "inductor", "mode": None, "dynamic": None, "fullgraph": False,
                                                  "regions": "blocks", "block_class": "LlamaDecoderLayer",
                                                  "num_blocks": 4, "cpu_gemm": "default", "when": "always",
                                                  "cache_dir": "auto"}
        assert "4 x LlamaDecoderLayer compiled in place" in d.reason

    def test_auto_is_off_on_cpu_and_points_to_fast(self):
        d = plan_for(get_preset("auto"), fake_caps(**CPU_NO_BF16), TINY_INFO)["compile"]
        assert d.applied == "off" and not d.active
        assert "auto: off on cpu" in d.reason and "preset 'fast'" in d.reason

    def test_explicit_true_compiles_on_cpu(self):
        d = plan_for(compile_cfg(backend="inductor", mode="max-autotune", regions="blocks+head"),
                       fake_caps(**CPU_NO_BF16), TINY_INFO)["compile"]
        assert d.applied == "blocks+head:inductor"
        assert d.settings.mode == "max-autotune" and d.settings.regions == "blocks+head"
        assert "final norm, lm_head and loss" in d.reason

    def test_disabled(self):
        d = plan_for(get_preset("baseline"), fake_caps(**CUDA_H100), TINY_INFO)["compile"]
        assert d.applied == "off" and d.reason == "compile.enabled = false"

    def test_no_compiler_falls_back_with_reason(self):
        caps = fake_caps(**{**CPU_NO_BF16, "compile": False,
                            "compile_reason": "inductor on CPU needs a C++ compiler (gcc/clang); none on PATH"})
        d = plan_for(compile_cfg(), caps, TINY_INFO)["compile"]
        assert d.applied == "off"
        assert "needs a C++ compiler" in d.reason
        assert d.fallbacks and d.fallbacks[0].startswith("compile: torch.compile is not usable here")

    def test_no_block_class_is_off_with_reason(self):
        info = ModelInfo(architecture="Odd", block_class=None, num_blocks=0)
        d = plan_for(compile_cfg(), fake_caps(**CUDA_H100), info)["compile"]
        assert d.applied == "off"
        assert "no repeated decoder block found" in d.reason

    def test_cudagraphs_backend_needs_cuda(self):
        d = plan_for(compile_cfg(backend="cudagraphs"), fake_caps(**CPU_NO_BF16), TINY_INFO)["compile"]
        assert d.applied == "off" and "needs a CUDA device" in d.reason

    def test_users_whole_model_torch_compile_is_left_alone(self, make_args):
        args = make_args(torch_compile=True)
        d = plan_for(compile_cfg(), fake_caps(**CUDA_H100), TINY_INFO, args)["compile"]
        assert d.applied == "off"
        assert "TrainingArguments.torch_compile=True" in d.reason and "compiled twice" in d.reason
        assert rc.training_args(d, args) == {}

    def test_a_model_the_caller_compiled_whole_is_left_alone(self, tiny_model):
        """torch.compile(model) or model.compile(): regional compile inside it would be traced through and
        its guards lost; the caller's compile is kept and the entry says so."""
        outer = torch.compile(tiny_model, backend="eager")
        d = plan_for(compile_cfg(), fake_caps(**CPU_NO_BF16), outer)["compile"]
        assert d.applied == "off" and "already compiled whole" in d.reason
        assert plan_for(compile_cfg(), fake_caps(**CPU_NO_BF16), tiny_model)["compile"].active
        tiny_model.compile(backend="eager")
        assert plan_for(compile_cfg(), fake_caps(**CPU_NO_BF16), tiny_model)["compile"].applied == "off"

    def test_dynamic_shapes_on_cuda_keep_max_autotune_but_not_its_cuda_graphs(self):
        """CUDA graphs with a dynamic sequence dimension are re-recorded for every new length (a growing pool)."""
        d = plan_for(compile_cfg(backend="inductor", mode="max-autotune", dynamic=True), fake_caps(**CUDA_H100),
                       TINY_INFO)["compile"]
        assert rc.compile_kwargs_of(d)["mode"] == "max-autotune-no-cudagraphs"
        assert "max-autotune without CUDA graphs" in d.reason
        static = plan_for(compile_cfg(backend="inductor", mode="max-autotune", dynamic=False),
                            fake_caps(**CUDA_H100), TINY_INFO)["compile"]
        assert rc.compile_kwargs_of(static)["mode"] == "max-autotune"

    def test_fasts_max_autotune_on_cuda_with_dynamic_rows_compiles_in_mode_default(self, tiny_model):
        """Measured on an H200: max-autotune-no-cudagraphs on a 1B Llama's 16 dynamic blocks had not finished
        compiling after 150 s (16 stock steps: 5 s). The preset's choice yields; the user's own is kept."""
        d = plan_for("fast", fake_caps(**CUDA_H100), tiny_model)["compile"]
        assert d.settings.dynamic is True and rc.compile_kwargs_of(d)["mode"] == "default"
        assert "mode default, not the preset's max-autotune" in d.reason
        mine = get_preset("fast").replace(compile={"mode": "max-autotune"})
        d = plan_for(mine, fake_caps(**CUDA_H100), tiny_model)["compile"]
        assert rc.compile_kwargs_of(d)["mode"] == "max-autotune-no-cudagraphs"
        assert "mode default" not in d.reason

    def test_static_shapes_without_padding_warns_about_recompiles(self):
        d = plan_for(compile_cfg(dynamic=False), fake_caps(**CUDA_H100), TINY_INFO)["compile"]
        assert "each new sequence length recompiles" in d.reason
        cfg = compile_cfg(dynamic=False).replace(data={"pad_to_multiple_of": 64})
        assert "recompiles" not in plan_for(cfg, fake_caps(**CUDA_H100), TINY_INFO)["compile"].reason

    def test_notes_lora_and_checkpointing_from_earlier_decisions(self, tiny_model):
        from hf_speedup.plan_types import Decision, PlanContext

        ctx = PlanContext(config=compile_cfg(), caps=fake_caps(**CUDA_H100), model=TINY_INFO, args=None)
        ctx.decisions["lora"] = Decision("lora", True, "lora", "r=16")
        ctx.decisions["fsdp"] = Decision("fsdp", True, "fsdp2:full_shard", "sharded")
        d = rc.decide(ctx)
        assert "peft LoRA layers" in d.reason and "FSDP hooks installed later still run" in d.reason

    def test_invalid_settings_are_rejected_with_allowed_values(self):
        from hf_speedup.config import SpeedupConfigError

        with pytest.raises(SpeedupConfigError, match=r"compile.regions = 'head' is not allowed; allowed: 'blocks', "
                                                      r"'blocks\+head'"):
            get_preset("fast").replace(compile={"regions": "head"})


# --------------------------------------------------------------------------------------------- apply
class TestApply:
    def test_blocks_compiled_in_place_and_outputs_unchanged(self, tiny_model, tokenizer):
        reference = copy.deepcopy(tiny_model)
        layers = list(tiny_model.model.layers)
        decision, outcome = compiled(tiny_model)
        assert list(tiny_model.model.layers) == layers  # same objects: no OptimizedModule wrappers
        assert all(isinstance(b._compiled_call_impl, rc.GuardedRegion) for b in layers)
        assert "_orig_mod" not in "".join(tiny_model.state_dict())
        inputs = batch(tokenizer, [12, 9])
        loss, grads = loss_and_grads(tiny_model, inputs)
        ref_loss, ref_grads = loss_and_grads(reference, inputs)
        torch.testing.assert_close(loss, ref_loss)
        assert_same_grads(grads, ref_grads)
        assert rc.compile_stats(tiny_model)["compiles"] >= 1
        assert outcome.facts["compiled_head"] == []

    def test_apply_is_idempotent(self, tiny_model):
        decision, outcome = compiled(tiny_model)
        regions = [b._compiled_call_impl for b in tiny_model.model.layers]
        rc.apply(decision, Setup(model=tiny_model, args=None), outcome)
        assert [b._compiled_call_impl for b in tiny_model.model.layers] == regions
        assert len(rc.guarded_regions(tiny_model)) == 4

    def test_off_decision_is_a_no_op(self, tiny_model):
        d = plan_for(get_preset("baseline"), fake_caps(**CPU_NO_BF16), tiny_model)["compile"]
        rc.apply(d, Setup(model=tiny_model, args=None), Outcome())
        assert all(b._compiled_call_impl is None for b in tiny_model.model.layers)

    def test_head_regions_compile_norm_lm_head_and_loss(self, tiny_model, tokenizer):
        reference = copy.deepcopy(tiny_model)
        decision, outcome = compiled(tiny_model, backend="aot_eager", regions="blocks+head")
        assert outcome.facts["compiled_head"] == ["final_norm", "lm_head", "loss"]
        kinds = sorted(r.kind for r in rc.guarded_regions(tiny_model))
        assert kinds == ["LlamaDecoderLayer"] * 4 + ["final_norm", "lm_head", "loss"]
        inputs = batch(tokenizer, [10, 10])
        loss, grads = loss_and_grads(tiny_model, inputs)
        ref_loss, ref_grads = loss_and_grads(reference, inputs)
        torch.testing.assert_close(loss, ref_loss)
        assert_same_grads(grads, ref_grads)
        stats = rc.compile_stats(tiny_model)
        assert stats["compiles"] == 4 and stats["recompiles"] == 0  # the nn.Linear head really compiled too

    def test_generation_with_a_kv_cache_runs_the_blocks_eager_and_training_still_compiles(self, tiny_model, tokenizer):
        """Each block's cache slot would be a new guard on the one forward all blocks share: generate() (TRL's
        online trainers call it between steps) would spend the recompile limit and leave training eager."""
        compiled(tiny_model, backend="eager")
        tiny_model.config.use_cache = True
        tiny_model.eval()
        tiny_model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
        assert rc.compile_stats(tiny_model)["compiles"] == 0
        tiny_model.train()
        tiny_model.config.use_cache = False
        tiny_model(**batch(tokenizer, [10, 10])).loss.backward()
        assert rc.compile_stats(tiny_model)["compiles"] >= 1

    def test_loss_int_token_count_does_not_recompile(self, tiny_model, tokenizer):
        compiled(tiny_model, backend="aot_eager", regions="blocks+head")
        inputs = batch(tokenizer, [10, 10])
        for n in (17, 18, 19):
            tiny_model(**inputs, num_items_in_batch=n).loss.backward()
        loss_regions = [r for r in rc.guarded_regions(tiny_model) if r.kind == "loss"]
        assert loss_regions[0].compiles == 1


# --------------------------------------------------------------------------------------------- fallback
def failing_backend(gm, example_inputs):
    raise RuntimeError("boom: this backend cannot compile anything")


def failing_backward_backend():
    from torch._dynamo.backends.common import aot_autograd

    def bw_fail(gm, example_inputs):
        raise RuntimeError("boom in the backward compiler")

    return aot_autograd(fw_compiler=lambda gm, ex: gm, bw_compiler=bw_fail)


class TestFallback:
    def test_failing_region_runs_eager_and_says_why(self, tiny_model, tokenizer, caplog):
        reference = copy.deepcopy(tiny_model)
        for i, block in enumerate(tiny_model.model.layers):
            rc.compile_module(block, "LlamaDecoderLayer", f"LlamaDecoderLayer[{i}]", {"backend": failing_backend})
        inputs = batch(tokenizer, [8, 8])
        with caplog.at_level(logging.WARNING, logger="hf_speedup"):
            loss, grads = loss_and_grads(tiny_model, inputs)
        torch.testing.assert_close(loss, loss_and_grads(reference, inputs)[0])
        stats = rc.compile_stats(tiny_model)
        assert stats["compiled_regions"] == 0
        assert set(stats["fallbacks"]) == {f"LlamaDecoderLayer[{i}]" for i in range(4)}
        assert all("boom: this backend cannot compile anything" in r for r in stats["fallbacks"].values())
        assert "runs eager from now on (training goes on)" in caplog.text

    def test_backward_compile_failure_is_caught_in_the_forward(self, tiny_model, tokenizer):
        block = tiny_model.model.layers[0]
        rc.compile_module(block, "LlamaDecoderLayer", "LlamaDecoderLayer[0]", {"backend": failing_backward_backend()})
        loss, _ = loss_and_grads(tiny_model, batch(tokenizer, [8, 8]))  # backward must not raise
        assert torch.isfinite(loss)
        assert "boom in the backward compiler" in block._compiled_call_impl.fallback_reason

    def test_errors_of_the_input_are_not_swallowed(self, tiny_model):
        compiled(tiny_model)
        with pytest.raises(IndexError, match="index out of range"):
            tiny_model(input_ids=torch.tensor([[10_000, 3]]))
        assert rc.compile_stats(tiny_model)["fallbacks"] == {}

    def test_trainer_goes_on_and_report_names_the_fallen_blocks(self, tiny_model, dataset, collator, make_args,
                                                               monkeypatch):
        monkeypatch.setattr(install, "compile_kwargs_of", lambda d, cpu_gemm=None: {"backend": failing_backend})
        trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=2), train_dataset=dataset,
                                 data_collator=collator, speedup=compile_cfg())
        trainer.train()
        entry = trainer.speedup_report.to_dict()["plan"]["compile"]
        assert entry["engaged"] is False
        assert "0/4 LlamaDecoderLayer blocks compiled" in entry["reason"]
        assert "fell back to eager: LlamaDecoderLayer[0]: BackendCompilerFailed" in entry["reason"]
        assert trainer.state.global_step == 2


# --------------------------------------------------------------------------------------------- recompiles
class TestRecompiles:
    def test_blocks_that_hit_the_recompile_limit_or_never_ran_compiled_are_not_engaged(self, tiny_model, tokenizer):
        from types import SimpleNamespace

        decision, outcome = compiled(tiny_model, dynamic=False)
        trainer = SimpleNamespace(model=tiny_model, state=SimpleNamespace(global_step=0), is_in_train=True)
        assert rc.verify(decision, trainer, outcome)[0]  # train begin: nothing has run yet
        trainer.state.global_step = 3  # three steps, and no block forward went through its compiled region
        engaged, why = rc.verify(decision, trainer, outcome)
        assert not engaged and "no block forward of 3 training step(s) ran compiled code" in why
        tiny_model(**batch(tokenizer, [8, 8]))
        assert rc.verify(decision, trainer, outcome)[0]
        rc.guarded_regions(tiny_model)[0].compiles = verification._recompile_limit()  # every new shape now runs eager
        engaged, why = rc.verify(decision, trainer, outcome)
        assert not engaged and "hit torch._dynamo recompile_limit" in why
        assert "fix: set compile.dynamic: null (or true)" in why  # static shapes: padding alone cannot fix it

    def test_the_recompile_limit_is_read_under_torch_2_6s_name_too(self):
        """torch 2.6 calls it cache_size_limit (recompile_limit from 2.7): read by the new name only, the limit
        was None there and blocks that hit it were still reported engaged."""
        from types import SimpleNamespace

        from hf_speedup.compat import dynamo_recompile_limit

        assert dynamo_recompile_limit(SimpleNamespace(cache_size_limit=8)) == 8  # torch 2.6's config
        assert dynamo_recompile_limit(SimpleNamespace(recompile_limit=4, cache_size_limit=4)) == 4
        assert dynamo_recompile_limit() == verification._recompile_limit() == torch._dynamo.config.recompile_limit

    def test_static_shapes_recompile_per_length_and_are_counted(self, tiny_model, tokenizer):
        compiled(tiny_model, dynamic=False)
        for n in (8, 12, 16):
            tiny_model(**batch(tokenizer, [n, n]))
        stats = rc.compile_stats(tiny_model)
        assert (stats["compiles"], stats["recompiles"]) == (3, 2)

    def test_padding_to_a_multiple_keeps_one_graph(self, tiny_model, tokenizer):
        from hf_speedup.tiny import causal_lm_collator

        compiled(tiny_model, dynamic=False)
        collate = causal_lm_collator(tokenizer, pad_to_multiple_of=16)
        for n in (5, 9, 13, 16):
            rows = [{"input_ids": [1] + [5] * (n - 1)}, {"input_ids": [1, 5]}]
            tiny_model(**collate(rows))
        assert (rc.compile_stats(tiny_model)["compiles"], rc.compile_stats(tiny_model)["recompiles"]) == (1, 0)

    def test_dynamic_shapes_recompile_once(self, tiny_model, tokenizer):
        compiled(tiny_model, dynamic=None)  # automatic dynamic: static first, one dynamic graph after
        for n in (8, 12, 16, 20):
            tiny_model(**batch(tokenizer, [n, n]))
        assert rc.compile_stats(tiny_model)["recompiles"] == 1


# --------------------------------------------------------------------------------------------- composition
class TestComposition:
    def test_lora_blocks_compile_and_grads_match_eager(self, tiny_model, tokenizer):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        peft_model = get_peft_model(tiny_model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                           init_lora_weights=False))
        reference = copy.deepcopy(peft_model)
        decision, _ = compiled(peft_model, backend="aot_eager")
        assert decision.settings.num_blocks == 4
        blocks = rc.guarded_regions(peft_model)
        assert len(blocks) == 4
        inputs = batch(tokenizer, [12, 12])
        loss, grads = loss_and_grads(peft_model, inputs)
        ref_loss, ref_grads = loss_and_grads(reference, inputs)
        torch.testing.assert_close(loss, ref_loss)
        assert all("lora_" in n for n in grads)
        assert_same_grads(grads, ref_grads)
        assert rc.compile_stats(peft_model)["fallbacks"] == {}

    def test_checkpointing_plus_compile_gives_eager_grads(self, tiny_model, tokenizer):
        from hf_speedup.compat import enable_model_checkpointing

        reference = copy.deepcopy(tiny_model)
        enable_model_checkpointing(tiny_model, {"use_reentrant": False})
        tiny_model.train()
        assert all(b.gradient_checkpointing for b in tiny_model.model.layers)
        compiled(tiny_model, backend="aot_eager")
        inputs = batch(tokenizer, [12, 12])
        loss, grads = loss_and_grads(tiny_model, inputs)
        ref_loss, ref_grads = loss_and_grads(reference, inputs)
        torch.testing.assert_close(loss, ref_loss)
        assert_same_grads(grads, ref_grads)
        assert rc.compile_stats(tiny_model)["fallbacks"] == {}


# --------------------------------------------------------------------------------------------- verify
class TestVerify:
    def test_trainer_verifies_compiled_blocks(self, tiny_model, dataset, collator, make_args):
        trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=2), train_dataset=dataset,
                                 data_collator=collator, speedup=compile_cfg(backend="aot_eager"))
        trainer.train()
        entry = trainer.speedup_report.to_dict()["plan"]["compile"]
        assert entry["engaged"] is True and entry["applied"] == "blocks:aot_eager"
        assert "verified: 4/4 LlamaDecoderLayer blocks compiled (aot_eager, default)" in entry["reason"]

    def test_verify_reports_off_decisions_as_not_engaged(self, tiny_model, dataset, collator, make_args):
        trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=1), train_dataset=dataset,
                                 data_collator=collator, speedup="baseline")
        engaged, reason = rc.verify(trainer.speedup_plan["compile"], trainer, trainer.speedup_outcomes["compile"])
        assert engaged is False and reason == "compile.enabled = false"

    def test_verify_reads_the_live_model_not_the_plan(self, tiny_model, dataset, collator, make_args):
        trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=1), train_dataset=dataset,
                                 data_collator=collator, speedup=compile_cfg())
        tiny_model.model.layers[2]._compiled_call_impl = None  # someone undid one block
        engaged, reason = rc.verify(trainer.speedup_plan["compile"], trainer, trainer.speedup_outcomes["compile"])
        assert engaged is False and reason.startswith("3/4 LlamaDecoderLayer blocks compiled")


# --------------------------------------------------------------------------------------------- CPU GEMMs
class TestCpuGemm:
    def test_fast_preset_autotunes_gemms_on_cpu_only(self):
        cpu = plan_for(get_preset("fast"), fake_caps(**CPU_NO_BF16), TINY_INFO)["compile"]
        assert cpu.settings.cpu_gemm == "autotune" and "MKL or oneDNN" in cpu.reason
        cuda = plan_for(get_preset("fast"), fake_caps(**CUDA_H100), TINY_INFO)["compile"]
        assert cuda.settings.cpu_gemm == "default" and "oneDNN" not in cuda.reason
        default_mode = plan_for(compile_cfg(backend="inductor"), fake_caps(**CPU_NO_BF16), TINY_INFO)["compile"]
        assert default_mode.settings.cpu_gemm == "default"

    def test_compile_kwargs_carry_the_mode_as_options_plus_the_pass(self):
        d = plan_for(get_preset("fast"), fake_caps(**CPU_NO_BF16), TINY_INFO)["compile"]
        kw = rc.compile_kwargs_of(d)
        assert "mode" not in kw and kw["options"]["max_autotune"] is True
        assert kw["options"]["post_grad_custom_post_pass"] is rc.cpu_gemm_pass()
        assert rc.cpu_gemm_pass().uuid() == rc.cpu_gemm_pass().uuid()  # stable key: inductor's cache works

    def test_onednn_mm_op_is_exact_wherever_the_guard_allows_it(self):
        """On AMX CPUs oneDNN rounds fp32 GEMMs to bf16: there the guard must refuse it, elsewhere it is exact."""
        op = gemm._register_onednn_mm()
        a, b = torch.randn(64, 32), torch.randn(48, 32).t()  # a transposed operand, as in a linear
        assert op(a.to("meta"), b.to("meta")).shape == (64, 48)
        ok, why = rc.onednn_fp32_ok()
        if ok:
            torch.testing.assert_close(op(a, b), a @ b, rtol=1e-5, atol=1e-5)
        elif "would round fp32 GEMMs to bf16" in why:  # the refusal is right: the op really is inexact here
            assert not torch.allclose(op(a, b), a @ b, rtol=1e-5, atol=1e-5), why
        else:
            assert "cannot route fp32 matmuls to oneDNN" in why or "could not run here" in why, why

    def test_onednn_is_refused_where_it_would_round_to_bf16(self, monkeypatch):
        monkeypatch.setattr(gemm, "onednn_mm", lambda a, b: torch.mm(a.bfloat16().float(), b.bfloat16().float()))
        ok, why = rc.onednn_fp32_ok()
        assert not ok and "would round fp32 GEMMs to bf16" in why

    def test_no_precision_api_keeps_default_blas_and_says_why(self, monkeypatch):
        import hf_speedup.compat as compat

        monkeypatch.setattr(compat, "mkldnn_matmul_precision_api", lambda: None)
        d = plan_for(get_preset("fast"), fake_caps(**CPU_NO_BF16), TINY_INFO)["compile"]
        outcome = Outcome()
        cpu_gemm = rc.settle_cpu_gemm(d, outcome)
        state = FeatureState(d, outcome)
        assert cpu_gemm == "default" and state.to_dict()["settings"]["cpu_gemm"] == "default"
        assert state.fallbacks == (f"cpu_gemm: torch {torch.__version__} cannot route fp32 matmuls to oneDNN (no "
                                   "fp32_precision API); GEMMs stay on the default BLAS",)
        assert "options" not in rc.compile_kwargs_of(d, cpu_gemm)

    def test_pass_swaps_only_the_gemms_where_onednn_won(self, monkeypatch):
        from torch._subclasses.fake_tensor import FakeTensorMode

        monkeypatch.setattr(gemm, "GEMM_CHOICES", {})
        monkeypatch.setattr(gemm, "benchmark_gemm",
                            lambda key: {"choice": "onednn" if key[0][0][0] == 64 else "default"})
        graph = torch.fx.Graph()
        with FakeTensorMode():
            vals = {"a": torch.empty(64, 32), "b": torch.empty(32, 16), "c": torch.empty(8, 32)}
        nodes = {}
        for name, val in vals.items():
            nodes[name] = graph.placeholder(name)
            nodes[name].meta["val"] = val
        big = graph.call_function(torch.ops.aten.mm.default, (nodes["a"], nodes["b"]))
        small = graph.call_function(torch.ops.aten.mm.default, (nodes["c"], nodes["b"]))
        graph.output((big, small))
        rc.choose_cpu_gemms(graph)
        assert big.target is torch.ops.hf_speedup.onednn_mm.default
        assert small.target is torch.ops.aten.mm.default


# --------------------------------------------------------------------------------------------- inductor
@pytest.mark.slow
def test_inductor_blocks_and_head_match_eager_loss_and_grads(tiny_model, tokenizer):
    """The fast preset's compile settings for real: inductor, max-autotune (CPU GEMM choice), static shapes."""
    reference = copy.deepcopy(tiny_model)
    decision, outcome = compiled(tiny_model, backend="inductor", mode="max-autotune", dynamic=False,
                                 regions="blocks+head")
    inputs = batch(tokenizer, [16, 11, 16, 7])
    for _ in range(2):  # second call runs the cached kernels
        loss, grads = loss_and_grads(tiny_model, inputs)
    ref_loss, ref_grads = loss_and_grads(reference, inputs)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    assert_same_grads(grads, ref_grads, rtol=1e-3, atol=1e-5)
    stats = rc.compile_stats(tiny_model)
    assert stats["fallbacks"] == {} and stats["recompiles"] == 0 and stats["compiled_regions"] == 7
    assert decision.applied == "blocks+head:inductor"
    if FeatureState(decision, outcome).to_dict()["settings"]["cpu_gemm"] == "autotune":  # oneDNN computes fp32 on this CPU: GEMMs were autotuned
        assert sum(gemm.GEMM_NODES.values()) > 0 or "cache" in rc.cpu_gemm_summary()
