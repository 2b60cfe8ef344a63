"""attention: the kernel chosen per device, dtype and packing (fake capabilities), set and verified on the live
model's config._attn_implementation; liger: on only where it runs, through transformers' switch."""

from __future__ import annotations

import pytest

from conftest import CPU_NO_BF16, CUDA_H100, CUDA_V100, fake_caps
from hf_speedup import SpeedupConfigError, SpeedupTrainer, plan_for, get_preset
from hf_speedup.features import attention, liger


def plan(caps: dict, model, preset="auto", args=None, **attn):
    cfg = get_preset(preset) if isinstance(preset, str) else preset
    if attn:
        cfg = cfg.replace(attention=attn)
    return plan_for(cfg, caps=fake_caps(**caps), model=model, args=args)


@pytest.fixture
def flash_installed(monkeypatch):
    """Pretend flash-attn 2 and 3 are installed (never on CI's CPUs)."""
    monkeypatch.setattr(attention, "installed", lambda package: package in ("flash_attn", "flash_attn_interface"))


def test_cpu_picks_sdpa_varlen_for_padding_free_rows_and_sdpa_otherwise(tiny_model, make_args):
    packed = plan(CPU_NO_BF16, tiny_model, "fast", make_args(per_device_train_batch_size=8))["attention"]
    assert packed.applied == "sdpa_varlen" and packed.settings.packed
    assert "no work across sequences" in packed.reason
    unpacked = plan(CPU_NO_BF16, tiny_model, get_preset("fast").replace(data={"padding_free": False}))["attention"]
    assert unpacked.applied == "sdpa" and unpacked.reason.endswith("already the model's")


def test_cuda_picks_flash_by_generation_and_dtype(tiny_model, flash_installed, make_args):
    h100 = plan(CUDA_H100, tiny_model, "fast", make_args())["attention"]
    assert h100.applied == "flash_attention_3" and h100.settings.dtype == "bf16"
    fp32 = plan(CUDA_H100, tiny_model, get_preset("fast").replace(precision={"dtype": "fp32"}))["attention"]
    assert fp32.applied == "sdpa"
    assert "flash_attention_3 computes in bf16/fp16 and the plan trains in fp32" in fp32.reason
    v100 = plan(CUDA_V100, tiny_model, "auto")["attention"]
    assert v100.applied == "sdpa" and "needs compute capability >= 8.0" in v100.reason


def test_an_amd_gpu_never_gets_flash_attention_3(tiny_model, flash_installed):
    """ROCm reports MI300 as compute capability 9.4; FlashAttention-3's Hopper kernels do not run there."""
    mi300 = dict(CUDA_H100, device_name="AMD Instinct MI300X", compute_capability=(9, 4), tf32=False, rocm=True)
    d = plan(mi300, tiny_model, "fast")["attention"]
    assert d.applied == "flash_attention_2"
    assert "flash_attention_3 needs an NVIDIA Hopper GPU; this is an AMD GPU (ROCm)" in d.reason


def test_cuda_without_flash_packages_uses_sdpa_with_the_reason(tiny_model, monkeypatch):
    monkeypatch.setattr(attention, "installed", lambda package: False)
    d = plan(CUDA_H100, tiny_model, "fast")["attention"]
    assert d.applied == "sdpa" and "the flash-attn >= 2.3.3 package is not installed" in d.reason
    assert "block-diagonal mask" in d.reason  # padding-free rows still kept apart


def test_a_flash_package_counts_only_where_transformers_would_load_it(monkeypatch):
    """A ``flash_attn`` module can be flash-attn 4, or a flash-attn older than transformers takes: importable,
    yet refused. transformers' own check decides."""
    from transformers.utils import import_utils

    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda name, *a: object())  # every module importable
    monkeypatch.setattr(import_utils, "is_flash_attn_2_available", lambda: False)
    monkeypatch.setattr(import_utils, "is_flash_attn_3_available", lambda: True)
    assert not attention.installed("flash_attn") and attention.installed("flash_attn_interface")
    assert attention.installed("some_other_kernels")


def test_a_kernel_that_cannot_run_falls_back_and_says_so(tiny_model):
    d = plan(CPU_NO_BF16, tiny_model, implementation="flash_attention_2")["attention"]
    assert d.applied == "sdpa_varlen"  # the next best for the auto preset's padding-free rows on CPU
    assert d.fallbacks == ("flash_attention_2 -> sdpa_varlen: flash_attention_2 runs on CUDA GPUs; this is cpu",)
    unpacked = get_preset("auto").replace(data={"padding_free": False}, attention={"implementation": "flex_attention"})
    flex = plan(CPU_NO_BF16, tiny_model, unpacked)["attention"]
    assert flex.applied == "sdpa" and "no backward on CPU" in flex.fallbacks[0]


def test_strict_raises_naming_what_runs_here(tiny_model):
    with pytest.raises(SpeedupConfigError, match=r"attention.implementation = 'flash_attention_3' cannot run here "
                                                 r"\(flash_attention_3 runs on CUDA GPUs; this is cpu\).*allowed here: "
                                                 r"'sdpa', 'sdpa_varlen', 'blocked', 'eager'"):
        plan(CPU_NO_BF16, tiny_model, implementation="flash_attention_3", strict=True)


def test_bad_value_is_one_clear_error():
    with pytest.raises(SpeedupConfigError, match=r"attention.implementation = 'flash' is not allowed; allowed: 'auto', "
                                                 r"'keep', 'sdpa'"):
        get_preset("auto").replace(attention={"implementation": "flash"})


def test_keep_and_models_that_cannot_switch_are_left_alone(tiny_model):
    import torch

    from hf_speedup.model_info import describe_model

    assert plan(CPU_NO_BF16, tiny_model, "baseline")["attention"].applied == "off"
    d = plan(CPU_NO_BF16, describe_model(torch.nn.Sequential(torch.nn.Linear(2, 2))), implementation="sdpa")
    assert d["attention"].applied == "off" and "cannot switch its attention kernel" in d["attention"].reason


def test_the_kernel_is_set_on_the_live_model_and_verified(tiny_model, make_args, collator, dataset):
    cfg = get_preset("fast").replace(compile={"enabled": False})
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(), train_dataset=dataset, data_collator=collator,
                             speedup=cfg)
    assert trainer.model.config._attn_implementation == "sdpa_varlen"
    state = trainer.speedup_status["attention"]
    assert state.engaged and "config._attn_implementation=sdpa_varlen" in state.engaged_reason
    trainer.model.set_attn_implementation("sdpa")  # someone switches it back: verification sees it
    trainer.verify_speedup()
    assert not state.engaged and "MISMATCH: planned sdpa_varlen" in state.engaged_reason


# ------------------------------------------------------------------------------------------ liger
def test_liger_is_off_on_cpu_with_the_reason(tiny_model, make_args):
    d = plan(CPU_NO_BF16, tiny_model, "fast")["liger"]
    assert d.applied == "off" and d.reason.startswith("Liger's Triton kernels run on CUDA GPUs; this is cpu")
    assert liger.training_args(d, make_args()) == {}
    explicit = plan(CPU_NO_BF16, tiny_model, get_preset("fast").replace(liger={"enabled": True}))["liger"]
    assert explicit.fallbacks and explicit.fallbacks[0].startswith("liger: Liger's Triton kernels run on CUDA")


def test_liger_on_cuda_goes_through_transformers_switch(tiny_model, make_args, monkeypatch):
    monkeypatch.setattr(liger, "installed", lambda: True)
    monkeypatch.setattr(liger, "supported_model_types", lambda: frozenset({"llama"}))
    for preset in ("fast", "memory"):
        d = plan(CUDA_H100, tiny_model, get_preset(preset).replace(compile={"enabled": False}))["liger"]
        assert d.applied == "rms_norm,rope,swiglu,fused_linear_cross_entropy", preset
        assert liger.training_args(d, make_args()) == {"use_liger_kernel": True}
    monkeypatch.setattr(liger, "supported_model_types", lambda: frozenset({"qwen2"}))
    assert "no kernels for model type 'llama'" in plan(CUDA_H100, tiny_model, "fast")["liger"].reason
    monkeypatch.setattr(liger, "installed", lambda: False)
    assert "liger-kernel is not installed" in plan(CUDA_H100, tiny_model, "fast")["liger"].reason


def test_liger_under_trls_sft_trainer_is_its_layer_kernels_only(tiny_model, monkeypatch):
    """TRL 1.16's SFTTrainer turns Liger's fused linear cross-entropy off (its own fused LM head computes the
    loss): the plan must not claim it."""
    trl = pytest.importorskip("trl")
    monkeypatch.setattr(liger, "installed", lambda: True)
    monkeypatch.setattr(liger, "supported_model_types", lambda: frozenset({"llama"}))
    args = trl.SFTConfig(output_dir="unused", use_cpu=True, bf16=False, report_to=[])
    eager = get_preset("fast").replace(compile={"enabled": False})
    d = plan(CUDA_H100, tiny_model, eager, args)["liger"]
    assert d.applied == "rms_norm,rope,swiglu" and "TRL's SFTTrainer turns Liger's fused linear" in d.reason
    # compiled blocks: the layer kernels are all TRL would apply, and they break the blocks' compile
    d = plan(CUDA_H100, tiny_model, "fast", args)["liger"]
    assert d.applied == "off" and d.reason.startswith("TRL's SFTTrainer applies only Liger's layer kernels")
    # and a use_liger_kernel=True already in the SFTConfig (sft_config sets it, planned without a model) patches
    # nothing: every kernel switched off
    off = liger.training_args(d, args)
    assert off.keys() == {"liger_kernel_config"} and not any(off["liger_kernel_config"].values())
    assert {"rms_norm", "rope", "swiglu", "geglu", "fused_linear_cross_entropy"} <= off["liger_kernel_config"].keys()


def test_liger_beside_compiled_blocks_is_its_fused_loss_only(tiny_model, make_args, monkeypatch):
    """Liger's Triton autograd functions inside a compiled block fail dynamo's trace (torch 2.11 on an H200:
    every block fell back to eager); inductor fuses norm, rotary and SwiGLU itself, so only the loss kernel stays."""
    monkeypatch.setattr(liger, "installed", lambda: True)
    monkeypatch.setattr(liger, "supported_model_types", lambda: frozenset({"llama"}))
    decisions = plan(CUDA_H100, tiny_model, "fast")
    assert decisions["compile"].active
    d = decisions["liger"]
    assert d.applied == "fused_linear_cross_entropy" and "layer kernels (rms_norm, rope, swiglu) left out" in d.reason
    # every layer kernel a model family has (Gemma's GEGLU, LayerNorm models' layer_norm) stays out of the blocks;
    # the loss kernels keep the model's own defaults (Granite's plain cross-entropy may not be on with the fused one)
    assert liger.training_args(d, make_args()) == {"use_liger_kernel": True, "liger_kernel_config": {
        "rms_norm": False, "rope": False, "swiglu": False, "geglu": False, "layer_norm": False, "relu_squared": False}}

    # the user's own liger_kernel_config wins: the plan does not narrow it, and reports what it leaves on
    mine = make_args(liger_kernel_config={"rope": True})
    d = plan(CUDA_H100, tiny_model, "fast", mine)["liger"]
    assert d.applied == "rms_norm,rope,swiglu,fused_linear_cross_entropy"
    assert liger.training_args(d, mine) == {"use_liger_kernel": True}
    no_loss = make_args(liger_kernel_config={"fused_linear_cross_entropy": False, "swiglu": False})
    d = plan(CUDA_H100, tiny_model, "fast", no_loss)
    assert d["liger"].applied == "rms_norm,rope" and "liger_kernel_config=" in d["liger"].reason
    chunked = plan(CUDA_H100, tiny_model, get_preset("fast").replace(loss={"chunked": True}), no_loss)
    assert chunked["loss"].active  # no fused loss from Liger: the chunked loss is not kept out
    nothing = make_args(liger_kernel_config={k: False for k in ("rms_norm", "rope", "swiglu",
                                                                 "fused_linear_cross_entropy")})
    assert plan(CUDA_H100, tiny_model, "fast", nothing)["liger"].applied == "off"


def _liger_apply_functions():
    """Signatures of liger-kernel 0.8.5's apply functions for four families (what transformers filters
    liger_kernel_config by, and where each family's defaults live)."""
    def gemma(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, geglu=True, model=None):
        pass

    def granite(rope=True, cross_entropy=True, fused_linear_cross_entropy=False, rms_norm=True, swiglu=True,
                model=None):
        pass

    def nemotron(relu_squared=True, cross_entropy=False, fused_linear_cross_entropy=True, model=None):
        pass

    def deepseek_v3(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, swiglu=True,
                    model=None):
        pass

    def llava(cross_entropy=False, fused_linear_cross_entropy=True, model=None, **kwargs):  # the rest: text model's
        pass

    return {"gemma": gemma, "granite": granite, "nemotron": nemotron, "deepseek_v3": deepseek_v3, "llava": llava}


@pytest.mark.parametrize("model_type, eager, compiled", [
    ("gemma", "rms_norm,rope,geglu,fused_linear_cross_entropy", "fused_linear_cross_entropy"),
    ("granite", "rms_norm,rope,swiglu,cross_entropy", "cross_entropy"),
    ("nemotron", "relu_squared,fused_linear_cross_entropy", "fused_linear_cross_entropy"),
    ("deepseek_v3", "rms_norm,swiglu,fused_linear_cross_entropy", "fused_linear_cross_entropy"),
    ("llava", "rms_norm,rope,swiglu,fused_linear_cross_entropy", "fused_linear_cross_entropy"),
])
def test_liger_kernels_are_the_model_familys_own(model_type, eager, compiled, tiny_model, make_args, monkeypatch):
    """What Liger patches differs by family; the plan reads it from Liger's apply function, so the report names
    Gemma's GEGLU (it named SwiGLU), and beside compiled blocks Granite keeps its plain cross-entropy (forcing the
    fused one on would trip Liger's "cannot both be True" assertion when train() starts)."""
    from dataclasses import replace

    from hf_speedup.model_info import describe_model

    monkeypatch.setattr(liger, "installed", lambda: True)
    monkeypatch.setattr(liger, "apply_functions", _liger_apply_functions)
    info = replace(describe_model(tiny_model), model_type=model_type)
    eager_plan = plan(CUDA_H100, info, get_preset("fast").replace(compile={"enabled": False}), make_args())
    assert eager_plan["liger"].applied == eager
    d = plan(CUDA_H100, info, "fast", make_args())["liger"]
    assert d.applied == compiled
    config = liger.training_args(d, make_args())["liger_kernel_config"]
    assert not any(config.values()) and "fused_linear_cross_entropy" not in config
    assert liger.fused_loss_elsewhere(d) is (compiled == "fused_linear_cross_entropy")
    # the user's own config is read against the family's switches: only GEGLU left on is still Liger on
    if model_type == "gemma":
        only_geglu = make_args(liger_kernel_config={"rms_norm": False, "rope": False,
                                                    "fused_linear_cross_entropy": False})
        mine = plan(CUDA_H100, info, "fast", only_geglu)["liger"]
        assert mine.applied == "geglu" and not liger.fused_loss_elsewhere(mine)
    # both cross-entropies on (a user's cross_entropy=True over a fused-loss default): Liger would refuse at train()
    both = make_args(liger_kernel_config={"cross_entropy": True})
    if model_type != "granite":
        with pytest.raises(SpeedupConfigError, match=r"liger_kernel_config = \{'cross_entropy': True\}: .*both "
                                                     r"cross_entropy and fused_linear_cross_entropy.*fix: add"):
            plan(CUDA_H100, info, "fast", both)



def test_under_trl_beside_compiled_blocks_only_the_loss_kernels_stay(tiny_model, monkeypatch):
    """Granite under TRL's SFTTrainer with compiled blocks: TRL keeps Liger's plain cross-entropy on (it turns only
    the fused loss off), so Liger stays on for it, with every layer kernel switched off in liger_kernel_config."""
    from dataclasses import replace

    from hf_speedup.model_info import describe_model

    trl = pytest.importorskip("trl")
    monkeypatch.setattr(liger, "installed", lambda: True)
    monkeypatch.setattr(liger, "apply_functions", _liger_apply_functions)
    args = trl.SFTConfig(output_dir="unused", use_cpu=True, bf16=False, report_to=[])
    info = replace(describe_model(tiny_model), model_type="granite")
    d = plan(CUDA_H100, info, "fast", args)["liger"]
    assert d.applied == "cross_entropy" and "SFTConfig.use_liger_kernel with liger_kernel_config" in d.reason
    config = liger.training_args(d, args)["liger_kernel_config"]
    assert not any(config.values()) and {"rms_norm", "rope", "swiglu"} <= config.keys()

def test_liger_cross_entropy_alone_is_verified_in_torch(tiny_model, monkeypatch):
    """Granite beside compiled blocks: Liger's plain cross-entropy replaces torch.nn.functional.cross_entropy and
    nothing else; the verification looks there."""
    from types import SimpleNamespace

    import torch

    decision = SimpleNamespace(active=True, reason="", applied="cross_entropy")
    trainer = SimpleNamespace(model=tiny_model, args=SimpleNamespace(use_liger_kernel=True))
    # torch's own (Liger patches it process-wide: an earlier run in this process may have)
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", _function_from("torch.nn.functional", "cross_entropy"))
    assert liger.verify(decision, trainer, None)[0] is False
    monkeypatch.setattr(torch.nn.functional, "cross_entropy", _function_from("liger_kernel.transformers.functional",
                                                                              "liger_cross_entropy"))
    assert liger.verify(decision, trainer, None) == (True, "0 Liger module(s) in the model, rotary stock, loss Liger "
                                                           "cross-entropy")


def test_liger_verification_reads_the_live_model(tiny_model, monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(liger, "installed", lambda: True)
    monkeypatch.setattr(liger, "supported_model_types", lambda: frozenset({"llama"}))
    d = plan(CUDA_H100, tiny_model, get_preset("fast").replace(compile={"enabled": False}))["liger"]
    loss_only = plan(CUDA_H100, tiny_model, "fast")["liger"]
    trainer = SimpleNamespace(model=tiny_model, args=SimpleNamespace(use_liger_kernel=True))
    ok, why = liger.verify(d, trainer, None)
    assert not ok and "not patched yet" in why
    lce = _function_from("liger_kernel.transformers.model.llama", "lce_forward")
    tiny_model.__dict__["forward"] = lce.__get__(tiny_model)
    assert liger.verify(loss_only, trainer, None) == (True, "0 Liger module(s) in the model, rotary stock, loss fused "
                                                            "linear cross-entropy")
    del tiny_model.__dict__["forward"]
    # liger-kernel patches a live model by binding its forwards onto the instances; the classes stay stock
    liger_forward = _function_from("liger_kernel.transformers.rms_norm", "forward")
    tiny_model.model.norm.__dict__["forward"] = liger_forward.__get__(tiny_model.model.norm)
    ok, why = liger.verify(d, trainer, None)
    assert ok and why.startswith("1 Liger module(s) in the model, rotary stock, loss stock")
    # models built after that patching get Liger's classes
    first = tiny_model.model.layers[0].input_layernorm
    first.__class__ = type("LigerRMSNorm", (type(first),), {"__module__": "liger_kernel.transformers.rms_norm"})
    ok, why = liger.verify(d, trainer, None)
    assert ok and why.startswith("2 Liger module(s)")
    tiny_model.__dict__["forward"] = _function_from("liger_kernel.transformers.model.llama", "lce_forward").__get__(
        tiny_model)
    assert liger.verify(d, trainer, None)[1].endswith("loss fused linear cross-entropy")


def test_liger_fused_loss_is_seen_through_accelerates_mixed_precision_wrappers(tiny_model, monkeypatch):
    """Under bf16, ``accelerator.prepare`` (inside ``train()``, after Liger patched the forward) wraps the forward
    in autocast and an fp32 output cast: the outer function is accelerate's, Liger's is inside ``__wrapped__``."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    monkeypatch.setattr(liger, "installed", lambda: True)
    monkeypatch.setattr(liger, "supported_model_types", lambda: frozenset({"llama"}))
    d = plan(CUDA_H100, tiny_model, "fast")["liger"]
    tiny_model.__dict__["forward"] = _function_from("liger_kernel.transformers.model.llama", "lce_forward").__get__(
        tiny_model)
    model = Accelerator(mixed_precision="bf16", cpu=True).prepare(tiny_model)
    assert not model.forward.__func__.__module__.startswith("liger_kernel")  # accelerate's wrapper outside
    _, why = liger.verify(d, SimpleNamespace(model=model, args=SimpleNamespace(use_liger_kernel=True)), None)
    assert why.endswith("loss fused linear cross-entropy"), why  # it read "loss stock"
    assert liger.liger_parts(model)["fused_loss"] is True


def _function_from(module: str, name: str):
    namespace: dict = {"__name__": module}
    exec(f"def {name}(self, *args, **kwargs):\n    return None", namespace)
    return namespace[name]


def test_liger_verification_reads_what_the_real_liger_kernel_patches():
    """With liger-kernel installed, transformers' own switch patches a tiny Llama on CPU (patching runs no kernel)
    and the verification counts what it left. In a child process: Liger's patching is process-wide."""
    import subprocess
    import sys
    import textwrap

    pytest.importorskip("liger_kernel")
    script = textwrap.dedent("""
        from types import SimpleNamespace
        from transformers.integrations.liger import apply_liger_kernel
        from hf_speedup.features import liger
        from hf_speedup.tiny import tiny_llama
        model = tiny_llama()
        import sys
        loss_only = sys.argv[1] == "loss-only"  # beside compiled blocks: the config the plan sets
        model = tiny_llama()
        apply_liger_kernel(model, {k: False for k in liger.LAYER_KERNELS} if loss_only else None)
        decision = SimpleNamespace(active=True, reason="", applied=liger.LOSS_KERNEL if loss_only else None)
        print(liger.verify(decision, SimpleNamespace(model=model, args=SimpleNamespace(use_liger_kernel=True)), None))
    """)

    def verified(case: str) -> str:
        return subprocess.run([sys.executable, "-c", script, case], capture_output=True, text=True, check=True).stdout

    assert "(True, '13 Liger module(s) in the model, rotary Liger, loss fused linear cross-entropy')" in verified("all")
    assert "(True, '0 Liger module(s) in the model, rotary stock, loss fused linear cross-entropy')" in verified(
        "loss-only")


def test_the_memory_estimate_counts_no_full_logits_where_liger_computes_the_loss(tiny_model, monkeypatch):
    """memory preset on CUDA: with Liger the loss feature stands aside, and Liger's fused linear cross-entropy
    keeps the full logits out just as the chunked loss does; the estimate must not count them."""
    from hf_speedup import estimate_memory

    caps = fake_caps(**CUDA_H100)
    monkeypatch.setattr(liger, "installed", lambda: False)
    chunked = estimate_memory(tiny_model, speedup="memory", batch_size=8, seq_len=256, caps=caps)
    stock = estimate_memory(tiny_model, speedup={"base": "memory", "loss": {"chunked": False}}, batch_size=8,
                            seq_len=256, caps=caps)
    monkeypatch.setattr(liger, "installed", lambda: True)
    monkeypatch.setattr(liger, "supported_model_types", lambda: frozenset({"llama"}))
    fused = estimate_memory(tiny_model, speedup="memory", batch_size=8, seq_len=256, caps=caps)
    assert fused.sizes["logits_and_loss"] == chunked.sizes["logits_and_loss"] < stock.sizes["logits_and_loss"]


def test_a_kernel_the_model_refuses_at_apply_is_a_reported_fallback_or_with_strict_an_error(tiny_model, monkeypatch):
    """A kernel that passed the plan's checks but that transformers refuses when set (a broken flash-attn
    build, say): the model keeps its own, the fallback is in the report; with attention.strict it raises."""
    from types import SimpleNamespace

    from hf_speedup.features import Setup
    from hf_speedup.plan_types import Outcome

    d = plan(CPU_NO_BF16, tiny_model, get_preset("auto").replace(attention={"implementation": "eager"}))["attention"]
    assert d.settings.implementation == "eager" and tiny_model.config._attn_implementation == "sdpa"

    for error in (OSError("kernels-community/flash-attn2: cannot reach the hub"),  # the hub kernel it fetches
                  ImportError("flash_attn_2_cuda: undefined symbol")):
        def refuse(*a, _error=error, **k):
            raise _error

        monkeypatch.setattr(type(tiny_model), "set_attn_implementation", refuse)
        outcome = Outcome()
        attention.apply(d, Setup(model=tiny_model, args=None), outcome)
        assert tiny_model.config._attn_implementation == "sdpa" and outcome.applied == "sdpa"
        assert outcome.fallbacks == [f"eager: transformers refused it on this model ({error}); the model keeps sdpa"]
    engaged, why = attention.verify(d, SimpleNamespace(model=tiny_model), outcome)
    assert not engaged and "transformers refused it" in why

    strict = d.replace(settings=d.settings.__class__(**{**vars(d.settings), "strict": True}))
    with pytest.raises(SpeedupConfigError, match=r"attention.implementation = 'eager': transformers refused it .*"
                                                 r"attention.strict = true.*fix: repair the kernel's install"):
        attention.apply(strict, Setup(model=tiny_model, args=None), Outcome())


# ------------------------------------------------------------------------------- the model's own attention features
def softcapped_gemma2():
    """Gemma 2 with every layer full attention and its default attention-logit softcapping (50)."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
                                          layer_types=["full_attention"] * 2, pad_token_id=0, bos_token_id=1,
                                          eos_token_id=2))


def test_softcapped_attention_never_gets_sdpa(make_args):
    model = softcapped_gemma2()
    d = plan(CPU_NO_BF16, model, "auto", make_args())["attention"]  # padding-free rows, no sliding window
    assert d.applied == "eager"
    assert ("not sdpa_varlen, sdpa: Gemma2ForCausalLM caps its attention logits (attn_logit_softcapping=50), which "
            "torch's scaled_dot_product_attention cannot apply") in d.reason
    asked = plan(CPU_NO_BF16, model, "auto", make_args(), implementation="sdpa")["attention"]
    assert asked.applied == "eager" and asked.fallbacks[0].startswith("sdpa -> eager: Gemma2ForCausalLM caps")
    with pytest.raises(SpeedupConfigError, match=r"attention\.implementation = 'sdpa' cannot run here \(Gemma2ForCausalLM "
                                                 r"caps its attention logits.*allowed here: 'eager'"):
        plan(CPU_NO_BF16, model, "auto", make_args(), implementation="sdpa", strict=True)


def test_kernels_the_class_does_not_declare_are_not_planned():
    """sdpa_varlen is SDPA's math per sequence: a class without ``_supports_sdpa`` gets neither; a softcap on a
    class that does declare sdpa (Gemma 3 with the cap set) rules both out as well."""
    from hf_speedup.model_info import ModelInfo

    no_sdpa = ModelInfo(architecture="NoSdpaForCausalLM", block_class="Block", num_blocks=2,
                        attention_kernels=("interface",), packed_sequences=True)
    d = plan(CPU_NO_BF16, no_sdpa, "auto")["attention"]
    assert d.applied == "eager" and "not sdpa_varlen, sdpa: NoSdpaForCausalLM has no sdpa support" in d.reason
    capped = ModelInfo(architecture="Gemma3ForCausalLM", block_class="Block", num_blocks=2,
                       attention_kernels=("sdpa", "interface"), packed_sequences=True, attention_softcap=30.0)
    assert plan(CPU_NO_BF16, capped, "auto")["attention"].applied == "eager"


def test_softcapped_model_trains_eager_with_padding_free_rows(make_args, tokenizer, collator):
    from hf_speedup.tiny import make_dataset

    trainer = SpeedupTrainer(model=softcapped_gemma2(), args=make_args(max_steps=1), data_collator=collator,
                             train_dataset=make_dataset(tokenizer, n=16, seed=0), speedup="auto")
    state = trainer.speedup_status["attention"]
    assert state.engaged and state.applied == "eager" and not state.fallbacks
    assert trainer.model.config._attn_implementation == "eager"


def test_sdpa_varlen_refuses_a_softcap_it_cannot_apply():
    import torch

    from hf_speedup.features.attention import sdpa_varlen

    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"sdpa_varlen: Module caps its attention logits \(softcap\).*fix: set "
                                         r"attention\.implementation: eager"):
        sdpa_varlen.attention_forward(torch.nn.Module(), q, q, q, None, softcap=50.0,
                                      position_ids=torch.arange(4).unsqueeze(0))
