"""load_model: the load-time half of the plan (QLoRA config, dtype, GGUF), and GGUF files written here."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from conftest import CPU_NO_BF16, CUDA_H100, CUDA_V100, fake_caps
from gguf_fixture import save_gguf

from hf_speedup import SpeedupConfigError, plan_for, get_preset
from hf_speedup.loading import bnb_config, load_kwargs, load_model, split_gguf
from hf_speedup.model_info import describe_model
from hf_speedup.plan_types import Plan


def plan(cfg, caps=CPU_NO_BF16, **caps_kw):
    return plan_for(cfg, caps=fake_caps(**{**caps, **caps_kw}), model=None)


def qlora(**kw):
    return get_preset("qlora").replace(lora=kw) if kw else get_preset("qlora")


@pytest.mark.parametrize("name, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)])
def test_a_lora_base_loads_in_the_precision_decisions_dtype(name, dtype):
    p = plan(get_preset("lora").replace(precision={"dtype": name}), CUDA_H100)
    assert p["precision"].settings.dtype is dtype  # typed: a torch.dtype, not text to parse
    assert load_kwargs("some/model", p)[1]["dtype"] is dtype


def test_qlora_on_cuda_loads_nf4_double_quant_in_the_compute_dtype():
    from transformers import BitsAndBytesConfig

    p = plan(qlora(), CUDA_H100)
    path, kw = load_kwargs("some/model", p)
    q = kw["quantization_config"]
    want = p["precision"].settings.dtype
    assert path == "some/model" and isinstance(q, BitsAndBytesConfig)
    assert q.load_in_4bit and q.bnb_4bit_quant_type == "nf4" and q.bnb_4bit_use_double_quant
    assert q.bnb_4bit_compute_dtype is want and kw["dtype"] is want
    assert q.bnb_4bit_quant_storage == torch.uint8  # not sharded: bitsandbytes' packed bytes
    assert "device_map" not in kw


def test_quant_storage_matches_the_dtype_when_fsdp_shards():
    p = plan(qlora(), CUDA_H100)
    fsdp = p["fsdp"].replace(applied="full_shard")  # whatever FSDP decides, an active decision means sharding
    precision = p["precision"].replace(settings=dataclasses.replace(p["precision"].settings, dtype=torch.bfloat16))
    p = Plan(p.config, p.caps, p.model, {**p.decisions, "fsdp": fsdp, "precision": precision})
    q = bnb_config(p, "4bit")
    assert q.bnb_4bit_compute_dtype is torch.bfloat16 and q.bnb_4bit_quant_storage == torch.bfloat16
    fsdp = fsdp.replace(settings=dataclasses.replace(fsdp.settings, qlora_quant_storage=torch.float16))
    p = Plan(p.config, p.caps, p.model, {**p.decisions, "fsdp": fsdp})  # the FSDP decision's word wins
    assert bnb_config(p, "4bit").bnb_4bit_quant_storage == torch.float16


def test_each_rank_loads_its_quantized_copy_on_its_own_gpu():
    p = plan(qlora(), CUDA_H100, world_size=2, rank=1, local_rank=1)
    assert load_kwargs("m", p)[1]["device_map"] == {"": 1}


def test_eight_bit_base():
    q = load_kwargs("m", plan(qlora(quantization="8bit"), CUDA_V100))[1]["quantization_config"]
    assert q.load_in_8bit and not q.load_in_4bit


def test_qlora_without_cuda_loads_a_plain_float_base():
    p = plan(qlora())
    kw = load_kwargs("m", p)[1]
    assert "quantization_config" not in kw and kw["dtype"] is torch.float32
    assert p["lora"].fallbacks  # the reason travels with the plan


def test_full_finetune_loads_fp32_master_weights():
    assert load_kwargs("m", plan(get_preset("baseline"), CUDA_H100))[1] == {"dtype": torch.float32}


def test_callers_kwargs_win(caplog):
    p = plan(qlora(), CUDA_H100)
    with caplog.at_level(logging.INFO, logger="hf_speedup"):
        kw = load_kwargs("m", p, dtype=torch.float16, quantization_config=None, revision="main")[1]
    assert kw["dtype"] is torch.float16 and kw["quantization_config"] is None and kw["revision"] == "main"
    assert "keeping the caller's ['dtype', 'quantization_config']" in caplog.text


def test_gguf_paths(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"")
    assert split_gguf(f, {}) == (str(tmp_path), "m.gguf")
    assert split_gguf("org/repo", {"gguf_file": "x.gguf"}) == ("org/repo", "x.gguf")
    assert split_gguf("org/repo", {}) == ("org/repo", None)
    path, kw = load_kwargs(f, plan("lora"))
    assert (path, kw["gguf_file"]) == (str(tmp_path), "m.gguf")
    assert getattr(kw["quantization_config"], "dequantize", None) is True


def test_gguf_cannot_also_be_4bit(tmp_path, caplog):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"")
    with pytest.raises(SpeedupConfigError, match=r"lora\.quantization = '4bit' cannot apply to a GGUF file.*fix"):
        load_kwargs(f, plan(qlora(strict=True), CUDA_H100))
    p = plan(qlora(), CUDA_H100)
    with caplog.at_level(logging.WARNING, logger="hf_speedup"):
        kw = load_kwargs(f, p)[1]
    assert getattr(kw["quantization_config"], "dequantize", None) is True  # GGUF, dequantized: no bitsandbytes
    assert "cannot apply to a GGUF file" in caplog.text and "loading it dequantized" in caplog.text


# ----------------------------------------------------------------------------------------- real loads
def _same_logits(a, b, atol):
    x = torch.arange(3, 19).unsqueeze(0)
    with torch.no_grad():
        return torch.allclose(a(x).logits.float(), b(x).logits.float(), atol=atol)


def test_load_model_from_a_local_directory(tiny_model, tmp_path):
    tiny_model.save_pretrained(tmp_path / "tiny")
    model = load_model(tmp_path / "tiny", speedup="lora", caps=fake_caps(**CPU_NO_BF16))
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert _same_logits(model, tiny_model, atol=1e-5)


@pytest.mark.parametrize("quant, atol", [("f32", 1e-5), ("q8_0", 0.05)])
def test_gguf_roundtrip_loads_trainable(tiny_model, tmp_path, quant, atol):
    pytest.importorskip("gguf")
    path = save_gguf(tiny_model, tmp_path / f"tiny-{quant}.gguf", quant=quant)
    model = load_model(path, speedup="lora", caps=fake_caps(**CPU_NO_BF16))
    info = describe_model(model)
    assert info.quantization is None and not getattr(model, "is_quantized", False)
    assert (info.num_blocks, info.linear_names) == (4, describe_model(tiny_model).linear_names)
    assert all(p.is_floating_point() for p in model.parameters())
    assert _same_logits(model, tiny_model, atol=atol)
    from transformers.trainer_utils import validate_quantization_for_training

    validate_quantization_for_training(model)  # what Trainer.__init__ checks: passes without any flag surgery


def test_each_rank_loads_its_quantized_copy_on_its_own_gpu_under_fsdp_too(monkeypatch):
    """transformers loads a quantized model whole on every rank even under FSDP: without a device_map every
    rank would quantize onto cuda:0."""
    monkeypatch.setenv("LOCAL_RANK", "3")  # a launched run: FSDP through accelerate
    p = plan(get_preset("fsdp-lora").replace(lora={"quantization": "4bit"}), CUDA_H100, world_size=8, local_rank=3)
    assert p["fsdp"].active and p["fsdp"].settings.qlora_quant_storage is torch.bfloat16
    kw = load_kwargs("some/model", p)[1]
    assert kw["device_map"] == {"": 3}
    assert kw["quantization_config"].bnb_4bit_quant_storage == torch.bfloat16
