"""Checkpointed block inputs kept in host memory (checkpointing.offload): planned on CUDA only, with the reason
elsewhere; the mechanism on CPU (a separate copy stands in for host memory): exact gradients, the device input let
go after the forward, every input brought back once, the one before prefetched; verification reads it live."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import CPU_NO_BF16, CUDA_H100, fake_caps

from hf_speedup import get_preset, plan_for
from hf_speedup.blocks import find_blocks
from hf_speedup.features import Setup, checkpointing
from hf_speedup.features.checkpointing.mechanism import enable_block_checkpointing
from hf_speedup.features.checkpointing.offload import BlockInputOffloader
from hf_speedup.plan_types import Outcome
from hf_speedup.tiny import tiny_llama


def _model(offloader=None):
    model = tiny_llama(seed=0)
    model.train()
    model.config.use_cache = False
    blocks = find_blocks(model)
    enable_block_checkpointing(blocks, range(len(blocks)), {"use_reentrant": False}, offloader=offloader)
    return model


def test_planned_on_cuda_and_said_not_needed_on_cpu():
    cuda = plan_for("long", caps=fake_caps(**CUDA_H100), model=tiny_llama())["checkpointing"]
    assert cuda.settings.offload and cuda.applied == "non-reentrant, inputs offloaded"
    assert "copies on a side stream, the next block's input prefetched during backward" in cuda.reason
    assert "transformers' own offload copies on the compute stream" in cuda.reason
    cpu = plan_for("long", caps=fake_caps(**CPU_NO_BF16), model=tiny_llama())["checkpointing"]
    assert not cpu.settings.offload and cpu.applied == "non-reentrant"
    assert "on a cpu device they already live in host memory, there is nothing to offload to" in cpu.reason
    memory = plan_for("memory", caps=fake_caps(**CUDA_H100), model=tiny_llama())["checkpointing"]
    assert not memory.settings.offload  # memory keeps its inputs on the device (offload is long's)


def test_gradients_are_exact_with_the_inputs_offloaded():
    ids = torch.randint(0, 512, (2, 33))
    grads = []
    for offloader in (None, BlockInputOffloader()):
        model = _model(offloader)
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_the_device_input_is_let_go_after_the_forward_and_each_comes_back_once():
    ids = torch.randint(0, 512, (1, 20))
    for offloader, kept in ((None, True), (BlockInputOffloader(), False)):
        model = _model(offloader)
        inputs = []
        for b in find_blocks(model)[1:]:  # the first block's input is the embedding output (the embedding keeps it)
            b.register_forward_pre_hook(lambda m, a: inputs.append(weakref.ref(a[0])))
        loss = model(input_ids=ids, labels=ids).loss
        gc.collect()
        assert [r() is not None for r in inputs] == [kept] * 3, offloader  # plain checkpointing keeps each input
        loss.backward()
        if offloader is not None:
            assert offloader.copies == offloader.fetches == 4


def test_the_recompute_of_a_block_prefetches_the_input_of_the_one_before():
    offloader = BlockInputOffloader()
    model = _model(offloader)
    ids = torch.randint(0, 512, (1, 16))
    loss = model(input_ids=ids, labels=ids).loss
    copies = [r() for r in offloader._order]
    assert len(copies) == 4 and all(c.back is None for c in copies)
    fetched = []
    real_fetch = type(copies[0]).fetch

    def watch(self):
        fetched.append((copies.index(self), [c.back is not None for c in copies]))
        return real_fetch(self)

    type(copies[0]).fetch = watch
    try:
        loss.backward()
    finally:
        type(copies[0]).fetch = real_fetch
    order = [i for i, _ in fetched]
    assert order == [3, 2, 1, 0], order  # backward order
    for i, ready in fetched[1:]:
        assert ready[i], (i, ready)  # already brought back when its recompute asked for it


def test_verification_reads_the_offloader_on_the_live_blocks():
    model = tiny_llama()
    decision = plan_for(get_preset("long"), caps=fake_caps(**CUDA_H100), model=model)["checkpointing"]
    outcome = Outcome()
    checkpointing.apply(decision, Setup(model=model, args=None), outcome)

    class Trainer:
        pass

    trainer = Trainer()
    trainer.model = model
    engaged, reason = checkpointing.verify(decision, trainer, outcome)
    assert engaged, reason
    assert "inputs kept in pinned host memory (0 copied out, 0 brought back so far)" in reason
    assert "recomputed exactly blocks 0, 1, 2, 3" in reason
    for block in find_blocks(model):  # the blocks checkpointed plainly: verify says the offload is gone
        block._gradient_checkpointing_func = torch.utils.checkpoint.checkpoint
    engaged, reason = checkpointing.verify(decision, trainer, outcome)
    assert not engaged and "no block keeps its input in host memory (offload was planned)" in reason


# ---------------------------------------------------------------------------------------- on a GPU (the GPU plan)
def _cuda_llama(layers=8, hidden=1024):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, vocab_size=1024, max_position_embeddings=32768)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16)
    model.train()
    model.config.use_cache = False
    return model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_block_inputs_leave_the_device_and_the_gradients_stay():
    """Device memory: the offloaded run's peak is lower by about the blocks' inputs (7 of 8 blocks x 16,384 tokens x
    1,024 x 2 bytes = 224 MiB; the last block's input is brought back at once); gradients equal."""
    seq, results = 16384, []
    ids = torch.randint(0, 1024, (1, seq), device="cuda")
    for offloader in (None, BlockInputOffloader()):
        model = _cuda_llama()
        blocks = find_blocks(model)
        enable_block_checkpointing(blocks, range(len(blocks)), {"use_reentrant": False}, offloader=offloader)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        results.append((torch.cuda.max_memory_allocated() - base, [p.grad.float() for p in model.parameters()]))
        if offloader is not None:
            assert offloader.copies == offloader.fetches == len(blocks)
        del model
    (plain, g_plain), (off, g_off) = results
    inputs = 7 * seq * 1024 * 2
    assert plain - off >= 0.7 * inputs, (plain, off, inputs)
    assert all(torch.allclose(a, b, rtol=1e-2, atol=1e-4) for a, b in zip(g_plain, g_off))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_tiled_mlp_lowers_the_peak_of_the_recompute():
    from hf_speedup.features.tiled_mlp.mechanism import TileRule, mlp_of, tile_mlp

    seq, peaks = 16384, []
    ids = torch.randint(0, 1024, (1, seq), device="cuda")
    for tiles in (None, 8):
        model = _cuda_llama(layers=2)
        blocks = find_blocks(model)
        enable_block_checkpointing(blocks, range(len(blocks)), {"use_reentrant": False})
        if tiles:
            for b in blocks:
                tile_mlp(mlp_of(b)[1], TileRule(fixed_tiles=tiles))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        del model
    mlp_whole = seq * 4096 * 2 * 4  # gate, up, act(gate), product of the whole sequence in bf16: 512 MiB
    assert peaks[0] - peaks[1] >= 0.5 * mlp_whole, peaks
