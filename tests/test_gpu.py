"""The GPU plan's assertions (``pytest -m gpu``; one H100, under 10 minutes): what only a GPU can prove.

Each test checks the live objects, not the report's word for them: every decoder block compiled under ``fast``
with no fallback, TF32 readable the way inductor reads it, Liger's modules in the forward, the attention kernel
the plan named in the profiler's operators, bitsandbytes states really int8 / paged, a QLoRA base really 4-bit,
FSDP2 over NCCL with one process, a CUDA memory snapshot that loads, MFU in (0, 1) and the peak memory within
15% of ``estimate_memory``. Run with benchmarks/gpu_plan.sh (benchmarks/RESULTS.md, "GPU plan").
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from distributed_helpers import launch_env
from hf_speedup import SpeedupTrainer, get_preset
from hf_speedup.blocks import find_blocks, unwrap_model
from hf_speedup.compat import unwrap_optimizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ROOT = Path(__file__).resolve().parents[1]


def _trainer(speedup, model, dataset, collator, make_args, **kw):
    args = make_args(use_cpu=False, **{"max_steps": 4, "per_device_train_batch_size": 8, **kw})
    return SpeedupTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator, speedup=speedup)


def _batch(trainer):
    return trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))


def _forward_backward(trainer, batch) -> None:
    """One training forward and backward, as a step runs them: under the accelerator's autocast (bf16 where the plan
    is; before ``train()`` the model is not yet wrapped in it)."""
    trainer.model.train()
    with trainer.accelerator.autocast():
        loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()


@pytest.fixture(autouse=True)
def _liger_undone(monkeypatch):
    """Liger patches transformers' Llama module for the whole process (its RMSNorm, MLP and rotary function): put
    them back after each test, so the next builds a stock model (the memory estimate models stock modules)."""
    from transformers.models.llama import modeling_llama

    for name in ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    yield
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------ compile + TF32
@pytest.mark.parametrize("mode", ["preset", "max-autotune"])
def test_fast_compiles_every_block_with_no_fallback_under_tf32(tiny_model, dataset, collator, make_args, mode):
    """max-autotune autotunes every GEMM on CUDA, and inductor keys that with torch.get_float32_matmul_precision():
    were TF32 set through torch's new API alone, that read raised and every block fell back to eager. The preset as
    it is compiles padding-free rows in mode default; max-autotune asked for keeps its GEMM autotuning."""
    from hf_speedup.features.compile import compile_stats

    cfg = get_preset("fast") if mode == "preset" else get_preset("fast").replace(compile={"mode": mode})
    trainer = _trainer(cfg, tiny_model, dataset, collator, make_args, max_steps=6)
    expected = "default" if mode == "preset" else "max-autotune-no-cudagraphs"
    assert trainer.speedup_plan["compile"].settings.mode == expected
    trainer.train()
    blocks = len(find_blocks(unwrap_model(trainer.model)))
    stats = compile_stats(trainer.model)
    state = trainer.speedup_status["compile"]
    assert state.engaged, state.engaged_reason
    assert stats["fallbacks"] == {} and stats["compiled_regions"] >= blocks, stats
    assert f"{blocks}/{blocks} " in state.engaged_reason
    assert trainer.speedup_report.to_dict()["metrics"]["compiled_regions"] >= blocks
    assert torch.get_float32_matmul_precision() == "high"  # what inductor reads
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9: the new API agrees
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
    precision = trainer.speedup_status["precision"]
    assert precision.applied == "bf16+tf32" and precision.engaged, precision.engaged_reason
    from hf_speedup.features import liger

    if liger.installed():  # beside compiled blocks only Liger's loss kernel: its layer kernels break the trace
        kernels = trainer.speedup_status["liger"]
        assert kernels.decision.applied == "fused_linear_cross_entropy" and kernels.engaged, kernels.engaged_reason


# ------------------------------------------------------------------------------------------ kernels
def test_liger_kernels_are_patched_and_run_in_the_forward(tiny_model, dataset, collator, make_args):
    pytest.importorskip("liger_kernel")
    from hf_speedup.features.liger import _patched_by_liger, liger_parts

    cfg = get_preset("baseline").replace(precision={"dtype": "auto"}, liger={"enabled": True})
    trainer = _trainer(cfg, tiny_model, dataset, collator, make_args, max_steps=2)
    trainer.train()
    state = trainer.speedup_status["liger"]
    assert state.engaged, state.engaged_reason
    parts = liger_parts(trainer.model)
    assert parts["modules"] > 0 and parts["rope"] and parts["fused_loss"], parts
    calls: dict[str, int] = {}
    liger = [m for m in unwrap_model(trainer.model).modules() if _patched_by_liger(m)]
    hooks = [m.register_forward_hook(lambda m, i, o: calls.__setitem__(type(m).__name__,
                                                                       calls.get(type(m).__name__, 0) + 1))
             for m in liger]
    _forward_backward(trainer, _batch(trainer))
    for hook in hooks:
        hook.remove()
    assert sum(calls.values()) >= len(liger), calls  # every Liger module ran in the training forward


SDPA_OPS = ("aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
            "aten::_scaled_dot_product_cudnn_attention")


def test_the_attention_kernel_the_plan_named_is_the_one_that_ran(tiny_model, dataset, collator, make_args):
    trainer = _trainer("auto", tiny_model, dataset, collator, make_args, max_steps=1)
    name = trainer.speedup_plan["attention"].settings.implementation
    batch = _batch(trainer)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        _forward_backward(trainer, batch)
    ops = {e.key: e.count for e in prof.key_averages()}
    blocks = len(find_blocks(unwrap_model(trainer.model)))
    if name == "sdpa":
        ran = {op: n for op, n in ops.items() if op in SDPA_OPS}
        assert ran and sum(ran.values()) >= blocks, sorted(ops)  # a fused SDPA kernel per block, not the math one
    elif name.startswith("flash_attention"):
        assert any("flash_attn" in op for op in ops), sorted(ops)
    else:
        pytest.fail(f"auto planned {name} on {torch.cuda.get_device_name()}")


# ------------------------------------------------------------------------------------------ bitsandbytes
@pytest.mark.parametrize("name", ["adamw_8bit", "paged_adamw_8bit"])
def test_bitsandbytes_optimizer_states_are_int8_and_paged(name, dataset, collator, make_args):
    """8-bit states for every weight of 4,096 elements or more (bnb's min_8bit_size) but the embeddings, which
    transformers keeps 32-bit; paged states for those of 100,000 or more (bnb pages nothing smaller)."""
    pytest.importorskip("bitsandbytes")
    from torch import nn

    from hf_speedup.tiny import tiny_llama

    model = tiny_llama(seed=0)  # MLP weights 256 x 688: above bnb's paging threshold
    cfg = get_preset("baseline").replace(optimizer={"name": name})
    trainer = _trainer(cfg, model, dataset, collator, make_args, max_steps=2)
    trainer.train()
    state = trainer.speedup_status["optimizer"]
    assert state.engaged, state.engaged_reason
    opt = unwrap_optimizer(trainer.optimizer)
    embeddings = {id(m.weight) for m in unwrap_model(trainer.model).modules() if isinstance(m, nn.Embedding)}
    params = [p for g in opt.param_groups for p in g["params"]]
    want = {id(p) for p in params if p.numel() >= 4096 and id(p) not in embeddings}
    quantized = [p for p in params if opt.state[p]["state1"].dtype == torch.uint8]
    assert want and {id(p) for p in quantized} == want
    paged = name == "paged_adamw_8bit"
    assert opt.is_paged is paged
    for p in quantized:
        s = opt.state[p]
        assert s["state2"].dtype == torch.uint8 and "qmap1" in s and "absmax1" in s
        assert getattr(s["state1"], "is_paged", False) is (paged and p.numel() >= 100_000)
    assert not paged or any(getattr(opt.state[p]["state1"], "is_paged", False) for p in quantized)


def test_qlora_base_weights_are_4bit(tiny_model, tmp_path, dataset, collator, make_args):
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb

    from hf_speedup.loading import load_model

    tiny_model.save_pretrained(tmp_path / "tiny")
    model = load_model(tmp_path / "tiny", speedup="qlora")
    trainer = _trainer("qlora", model, dataset, collator, make_args, max_steps=3)
    trainer.train()
    lora = trainer.speedup_status["lora"]
    assert lora.applied == "qlora" and lora.engaged, lora.engaged_reason
    linears = [m for m in unwrap_model(trainer.model).modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) == 7 * len(find_blocks(unwrap_model(trainer.model)))  # q k v o gate up down
    for m in linears:
        w = m.weight
        assert isinstance(w, bnb.nn.Params4bit) and w.dtype == torch.uint8 and w.quant_state is not None
        assert w.quant_state.quant_type == "nf4" and not w.requires_grad


# ------------------------------------------------------------------------------------------ FSDP2 / NCCL
def test_fsdp2_shards_over_nccl_with_one_process(tmp_path):
    torchrun = shutil.which("torchrun") or pytest.skip("torchrun not on PATH")
    out = tmp_path / "fsdp"
    cmd = [torchrun, "--standalone", "--nproc_per_node", "1", str(ROOT / "tests" / "dist" / "fsdp_train.py"),
           "--out", str(out), "--phases", "main", "--cuda"]
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    main = json.loads((out / "rank0.json").read_text())["main"]
    assert main["backend"] == "nccl" and main["parameter_devices"] == ["cuda:0"]
    assert main["decision"]["engaged"] is True and main["all_dtensor"], main["decision"]
    assert main["decision"]["settings"]["version"] == 2
    assert main["losses"]["8"] < main["losses"]["1"]


# ------------------------------------------------------------------------------------------ measurement
def test_cuda_memory_snapshot_is_written_and_loads(tiny_model, dataset, collator, make_args):
    cfg = get_preset("baseline").replace(profile={"enabled": True, "wait": 1, "warmup": 0, "active": 1})
    trainer = _trainer(cfg, tiny_model, dataset, collator, make_args, max_steps=3)
    trainer.train()
    entry = trainer.speedup_report.profile["memory_snapshot"]
    assert entry["engaged"] is True, entry
    with open(entry["path"], "rb") as fh:
        snapshot = pickle.load(fh)
    assert snapshot["segments"] and snapshot["device_traces"] and any(snapshot["device_traces"])


def test_mfu_is_a_fraction_and_the_peak_memory_is_close_to_the_estimate(tokenizer, collator, make_args):
    from hf_speedup.tiny import tiny_llama, tokenized_columns

    model = tiny_llama(seed=0, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=512)
    columns = tokenized_columns(tokenizer, n=4096, seed=0, pack_to=512)
    rows = [dict(zip(columns, row)) for row in zip(*columns.values())]
    trainer = _trainer("auto", model, rows, collator, make_args, max_steps=8)
    trainer.train()
    metrics = trainer.speedup_report.to_dict()["metrics"]
    assert metrics["mfu"] is not None and 0 < metrics["mfu"] < 1, metrics
    peak, estimate = metrics["peak_memory_allocated_bytes"], metrics["estimated_peak_bytes"]
    assert estimate and abs(peak - estimate) <= 0.15 * peak, (peak, estimate)
