"""LoRA / QLoRA: target modules, fallbacks and strict errors, real wrapping, GGUF bases."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import CPU_NO_BF16, CUDA_H100, fake_caps

from hf_speedup import SpeedupConfigError, SpeedupTrainer, get_preset
from hf_speedup.plan import plan_for as make_plan
from hf_speedup.features import Setup, lora
from hf_speedup.plan_types import Outcome
from hf_speedup.model_info import ModelInfo, describe_model

LLAMA_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_cfg(**kw):
    return get_preset("baseline").replace(lora={"enabled": True, **kw})


def plan_for(cfg, model=None, caps=CPU_NO_BF16):
    return make_plan(cfg, caps=fake_caps(**caps), model=model)


# ----------------------------------------------------------------------------------------- decide
def test_auto_targets_every_projection_of_the_block(tiny_model):
    d = plan_for(lora_cfg(), tiny_model)["lora"]
    assert d.applied == "lora"
    assert d.settings.target_modules == LLAMA_PROJ
    assert "LlamaDecoderLayer" in d.reason and d.fallbacks == ()


def test_targets_overridable(tiny_model):
    assert plan_for(lora_cfg(target_modules=["q_proj", "v_proj"]), tiny_model)["lora"].settings.target_modules == ("q_proj", "v_proj")
    assert plan_for(lora_cfg(target_modules="all-linear"), tiny_model)["lora"].settings.target_modules == "all-linear"


def test_peft_mapping_only_when_no_block_is_known():
    info = ModelInfo(model_type="llama", num_blocks=0)
    d = plan_for(lora_cfg(), info)["lora"]
    assert d.settings.target_modules == ("q_proj", "v_proj") and "peft's default" in d.reason
    assert plan_for(lora_cfg(), None)["lora"].settings.target_modules == "all-linear"


def test_off_by_default_and_in_baseline(tiny_model):
    d = plan_for(get_preset("baseline"), tiny_model)["lora"]
    assert d.applied == "off" and not d.active


def test_qlora_without_cuda_falls_back_with_reason(tiny_model):
    d = plan_for(lora_cfg(quantization="4bit"), tiny_model)["lora"]
    assert (d.requested, d.applied, d.settings.quantization) == ("qlora", "lora", None)
    assert d.fallbacks and d.fallbacks[0].startswith("qlora -> lora: hf_speedup runs bitsandbytes on CUDA only")
    assert "CUDA" in d.reason


def test_qlora_without_cuda_strict_raises():
    with pytest.raises(SpeedupConfigError, match=r"lora\.quantization = '4bit' cannot be honoured: hf_speedup runs bitsandbytes on CUDA only.*"
                                                  r"allowed here: null.*fix: run on a CUDA machine"):
        plan_for(lora_cfg(quantization="4bit", strict=True), None)


def test_qlora_preset_falls_back_on_cpu(tiny_model):
    d = plan_for("qlora", tiny_model)["lora"]
    assert d.applied == "lora" and "qlora -> lora" in d.fallbacks[0]


def test_qlora_on_cuda_is_planned_for_load_time():
    d = plan_for(lora_cfg(quantization="4bit"), None, CUDA_H100)["lora"]
    assert (d.applied, d.settings.quantization) == ("qlora", "4bit")
    assert "NF4" in d.reason


def test_qlora_on_cuda_with_unquantized_model_points_to_load_model(tiny_model):
    d = plan_for(lora_cfg(quantization="4bit"), tiny_model, CUDA_H100)["lora"]
    assert d.applied == "lora" and "quantized when it is loaded" in d.fallbacks[0]
    assert "hf_speedup.load_model" in d.reason
    with pytest.raises(SpeedupConfigError, match=r"model passed in is not quantized.*fix: load it with hf_speedup\.load_model"):
        plan_for(lora_cfg(quantization="4bit", strict=True), tiny_model, CUDA_H100)


def test_prequantized_base_is_adapted_as_loaded():
    info = ModelInfo(model_type="llama", num_blocks=2, block_class="LlamaDecoderLayer", quantization="4bit",
                     linear_names=("q_proj", "v_proj"))
    d = plan_for(lora_cfg(), info)["lora"]  # CPU caps: the base is already 4-bit, nothing to fall back from
    assert (d.applied, d.settings.quantization) == ("qlora", "4bit") and d.fallbacks == ()
    d8 = plan_for(lora_cfg(quantization="8bit"), info)["lora"]
    assert d8.applied == "qlora" and d8.fallbacks == ("lora-8bit -> qlora: the model was loaded in 4bit",)


def test_existing_peft_model_is_reported_not_rewrapped(tiny_model, make_args, dataset, collator):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny_model, LoraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    trainer = SpeedupTrainer(model=peft_model, args=make_args(), train_dataset=dataset, data_collator=collator,
                             speedup=lora_cfg())
    d = trainer.speedup_status["lora"]
    assert trainer.model is peft_model and d.applied == "existing adapters"
    assert d.engaged and "existing adapters kept: {'default': ['q_proj']}; 4 LoRA layers" in d.engaged_reason


# ----------------------------------------------------------------------------------------- apply / verify
def _wrapped(model, cfg):
    plan = plan_for(cfg, model)
    setup = Setup(model=model, args=None)
    lora.apply(plan["lora"], setup, Outcome())
    return setup.model, plan["lora"]


class _T:  # the part of a Trainer verify reads
    def __init__(self, model):
        self.model = model


def test_wraps_exactly_the_expected_modules(tiny_model):
    from peft import PeftModel
    from peft.tuners.lora import Linear as LoraLinear

    model, d = _wrapped(tiny_model, lora_cfg())
    assert isinstance(model, PeftModel)
    layers = lora.lora_layers(model)
    assert len(layers) == 4 * len(LLAMA_PROJ)
    assert all(type(m) is LoraLinear for m in layers.values())
    assert sorted({n.split(".")[-1] for n in layers}) == sorted(LLAMA_PROJ)
    assert not any("lm_head" in n for n in layers)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_A" in n or "lora_B" in n for n in trainable)
    ok, why = lora.verify(d, _T(model), Outcome())
    assert ok, why
    assert why.startswith("28 LoRA layers: model.layers.*.self_attn.q_proj x4, model.layers.*.self_attn.k_proj x4")
    assert "(lora.Linear)" in why


def test_verify_catches_a_trainable_base_and_a_missing_target(tiny_model):
    model, d = _wrapped(tiny_model, lora_cfg(target_modules=["q_proj"]))
    d = d.replace(settings=dataclasses.replace(d.settings, target_modules=("q_proj", "down_proj")))  # claim more than was wrapped
    model.base_model.model.model.embed_tokens.weight.requires_grad_(True)
    ok, why = lora.verify(d, _T(model), Outcome())
    assert not ok
    assert "4 target layer(s) not wrapped" in why and "mlp.down_proj" in why
    assert "1 base parameter(s) still train" in why and "embed_tokens" in why


def test_dotted_target_suffix_is_accepted(tiny_model):
    model, _ = _wrapped(tiny_model, lora_cfg(target_modules=["self_attn.q_proj"]))
    assert sorted({n.split(".")[-1] for n in lora.lora_layers(model)}) == ["q_proj"]


def test_unknown_target_name_is_a_config_error(tiny_model):
    with pytest.raises(SpeedupConfigError, match=r"\['qq_proj'\] match no Linear layer.*allowed: \[.*'q_proj'.*fix"):
        _wrapped(tiny_model, lora_cfg(target_modules=["qq_proj"]))


def test_lora_trains_only_adapters_and_loss_falls(tiny_model, make_args, dataset, collator):
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    args = make_args(max_steps=20, learning_rate=2e-2, lr_scheduler_type="constant", per_device_train_batch_size=8,
                     logging_steps=4)
    trainer = SpeedupTrainer(model=tiny_model, args=args, train_dataset=dataset, data_collator=collator,
                             speedup=lora_cfg(dropout=0.0))
    assert trainer.speedup_status["lora"].engaged
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    # A random base with a random lm_head bounds what adapters can reach (logits stay small), so the
    # fall is modest but clear; frozen adapters would leave the loss at its first value.
    assert sum(losses[-3:]) / 3 < losses[0] - 0.05, losses
    base = trainer.model.get_base_model()
    for n, p in base.named_parameters():
        if "lora_" not in n:
            key = n.replace(".base_layer", "")
            assert torch.equal(p, before[key]), f"frozen weight {n} changed"


# ----------------------------------------------------------------------------------------- GGUF
@pytest.fixture
def gguf_path(tiny_model, tmp_path):
    pytest.importorskip("gguf")
    from gguf_fixture import save_gguf

    return save_gguf(tiny_model, tmp_path / "tiny-q8_0.gguf", quant="q8_0")


def test_gguf_model_is_refused_by_stock_trainer_but_trains_under_lora(gguf_path, tiny_model, make_args, dataset, collator):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.trainer_utils import validate_quantization_for_training

    stock = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if not getattr(stock, "is_quantized", False):
        pytest.skip("this transformers does not flag dequantized GGUF models as quantized")
    assert describe_model(stock).quantization == "gguf"
    with pytest.raises(ValueError, match=r"(?i)quantized with .*gguf.*do not support training"):  # even with LoRA attached: the bug we work around
        validate_quantization_for_training(get_peft_model(stock, LoraConfig(r=4, target_modules=["q_proj"])))

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    x = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():  # the GGUF really holds the tiny model's weights (q8_0 rounding only)
        assert torch.allclose(model(x).logits, tiny_model(x).logits, atol=0.05)
    trainer = SpeedupTrainer(model=model, args=make_args(max_steps=3), train_dataset=dataset,
                             data_collator=collator, speedup=lora_cfg())
    d = trainer.speedup_status["lora"]
    assert "GGUF base" in d.reason and d.settings.gguf is True
    assert "stale GGUF quantizer flag was cleared" in d.facts["gguf"]
    assert d.engaged and not trainer.model.get_base_model().is_quantized
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))


def test_gguf_model_full_fine_tunes_without_lora(gguf_path, make_args, dataset, collator):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    trainer = SpeedupTrainer(model=model, args=make_args(max_steps=2, learning_rate=1e-2), train_dataset=dataset,
                             data_collator=collator, speedup="baseline")
    trainer.train()
    assert not getattr(trainer.model, "is_quantized", False)
    assert not torch.equal(before, trainer.model.model.layers[0].mlp.up_proj.weight)  # the base itself trained


def test_gguf_with_packed_weights_is_refused_with_a_fix(gguf_path):
    from transformers import AutoModelForCausalLM

    from hf_speedup.gguf import clear_stale_gguf_quantizer

    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if getattr(model, "hf_quantizer", None) is None:
        pytest.skip("this transformers does not keep a GGUF quantizer")
    model.hf_quantizer.packed_modules = {"model.layers.0.self_attn.q_proj.weight": object()}
    with pytest.raises(ValueError, match=r"packed in GGUF blocks.*fix: load it dequantized with hf_speedup\.load_model"):
        clear_stale_gguf_quantizer(model)


# ----------------------------------------------------------------------------------------- QLoRA
def _bnb_cpu_4bit_or_skip(path):
    """bitsandbytes >= 0.48 quantizes on CPU too: it lets the QLoRA wiring run here (not the speed)."""
    pytest.importorskip("bitsandbytes")
    from hf_speedup.loading import load_model

    try:
        return load_model(path, speedup="qlora", caps=fake_caps(**CUDA_H100))
    except Exception as exc:  # no CPU backend in this bitsandbytes
        pytest.skip(f"bitsandbytes cannot quantize on this machine: {exc!r}")


def test_qlora_wiring_on_a_4bit_base(tiny_model, tmp_path, make_args, dataset, collator):
    tiny_model.save_pretrained(tmp_path / "tiny")
    model = _bnb_cpu_4bit_or_skip(tmp_path / "tiny")
    assert describe_model(model).quantization == "4bit"
    trainer = SpeedupTrainer(model=model, args=make_args(), train_dataset=dataset, data_collator=collator,
                             speedup="qlora")
    d = trainer.speedup_status["lora"]
    assert d.applied == "qlora" and d.settings.quantization == "4bit"
    assert d.engaged, d.engaged_reason
    assert "base weights Params4bit" in d.engaged_reason and "lora.Linear4bit" in d.engaged_reason
    layers = lora.lora_layers(trainer.model)
    assert len(layers) == 28 and all(type(m.get_base_layer().weight).__name__ == "Params4bit" for m in layers.values())
    ckpt = trainer.speedup_status["checkpointing"]  # the qlora preset checkpoints: once, non-reentrant, after peft
    assert ckpt.engaged and "4/4 LlamaDecoderLayer blocks" in ckpt.engaged_reason, ckpt.engaged_reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qlora_trains_on_gpu(tiny_model, tmp_path, make_args, dataset, collator):
    from hf_speedup.loading import load_model

    tiny_model.save_pretrained(tmp_path / "tiny")
    model = load_model(tmp_path / "tiny", speedup="qlora")
    assert describe_model(model).quantization == "4bit"
    args = make_args(use_cpu=False, max_steps=20, learning_rate=2e-2, lr_scheduler_type="constant", logging_steps=5)
    trainer = SpeedupTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator, speedup="qlora")
    d = trainer.speedup_status["lora"]
    assert d.applied == "qlora" and d.engaged, d.engaged_reason
    assert trainer.speedup_status["checkpointing"].engaged, trainer.speedup_status["checkpointing"].engaged_reason
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses[-1] < losses[0], losses


# ----------------------------------------------------------------------------------------- a real 4-bit base
@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory):
    from hf_speedup.tiny import tiny_llama

    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(seed=0).save_pretrained(path)
    return path


def _load_4bit(path, storage: torch.dtype):
    """bitsandbytes quantizes on CPU too: the real Params4bit/Linear4bit objects, no GPU needed."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                               bnb_4bit_quant_storage=storage)
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, device_map="cpu", dtype=torch.bfloat16)


@pytest.mark.parametrize("storage", [torch.uint8, torch.bfloat16], ids=["uint8", "bf16"])
def test_a_4bit_base_counts_the_weights_it_holds_whatever_its_storage(saved_tiny, storage):
    """2 weights per uint8 element, 4 per bf16 one (the storage FSDP-QLoRA loads with): the counts behind the
    report, MFU and the estimate must not change with the storage."""
    from hf_speedup.model_info import parameter_counts
    from hf_speedup.model_shape import model_shape
    from hf_speedup.tiny import tiny_llama

    full, quantized = tiny_llama(seed=0), _load_4bit(saved_tiny, storage)
    assert type(quantized.model.layers[0].mlp.up_proj.weight).__name__ == "Params4bit"
    assert quantized.model.layers[0].mlp.up_proj.weight.dtype == storage
    assert parameter_counts(quantized).total == parameter_counts(full).total
    assert model_shape(quantized).total_params == model_shape(full).total_params
    assert model_shape(quantized).block_params == model_shape(full).block_params


def test_qlora_is_verified_after_fsdp_turned_the_4bit_weights_into_plain_tensors(saved_tiny):
    """FSDP2 shards a Params4bit into a DTensor, dropping its class and quant state; bitsandbytes keeps the
    quant state on the Linear4bit module, and the verification reads it there."""
    model, d = _wrapped(_load_4bit(saved_tiny, torch.bfloat16), lora_cfg())
    assert d.settings.quantization == "4bit"
    assert lora.verify(d, _T(model), Outcome())[0]
    bases = [m.get_base_layer() for m in lora.lora_layers(model).values()]
    for base in bases:  # what the conversion leaves: the same storage, no Params4bit
        base.weight = torch.nn.Parameter(base.weight.data.clone(), requires_grad=False)
    ok, why = lora.verify(d, _T(model), Outcome())
    assert ok and "base weights Params4bit" in why, why
    bases[0].quant_state = None  # a base that really lost its quantization is still caught
    ok, why = lora.verify(d, _T(model), Outcome())
    assert not ok and "1 adapted layer(s) have no Params4bit base weight" in why


def test_a_model_an_earlier_trainer_adapted_resumes_through_the_same_adapters(make_args, dataset, collator, tmp_path):
    """peft adds its layers to the model it wraps: a second trainer handed the same object (as scripts and test
    suites do to resume) trains through the first trainer's PeftModel, and its adapter checkpoint loads."""
    from peft import PeftModel

    from hf_speedup.tiny import tiny_llama

    model = tiny_llama(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    args = make_args(output_dir=str(tmp_path / "run"), max_steps=4, save_strategy="steps", save_steps=2)
    first = SpeedupTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator, speedup="lora")
    first.train()
    second = SpeedupTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator, speedup="lora")
    assert isinstance(second.model, PeftModel) and second.model is first.model
    assert "adapted in place by an earlier trainer" in second.speedup_status["lora"].reason
    second.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert second.state.global_step == 4
