"""metrics.py against hand-computed numbers: token counting, parameter split, FLOPs/token, MFU, peaks,
steady state, compile counters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_speedup.model_info import parameter_counts
from hf_speedup.report import measure as M
from hf_speedup.peak_flops import OVERRIDE_ENV, peak_flops_for, resolve_peak_flops

# The conftest tiny model (hidden 64, intermediate 128, 4 layers, 4 heads, 2 kv heads, vocab 512), by hand:
#   per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64 = 12288; mlp 3 * 64*128 = 24576; 2 norms 128 -> 36992
#   4 layers 147968 + final norm 64 + lm_head 512*64 = 32768  -> 180800 matmul ("non-embedding") parameters
#   + embed_tokens 512*64 = 32768 -> 213568 in total
TINY_TOTAL = 213_568
TINY_NON_EMBEDDING = 180_800
TINY_EMBEDDING = 32_768


# ------------------------------------------------------------------------------------------ tokens
def test_count_tokens_excludes_padding_by_attention_mask():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 0], [5, 6, 0, 0], [5, 0, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 0, 0, 0]]),
        "labels": torch.tensor([[5, 6, 7, -100], [5, 6, -100, -100], [-100, -100, -100, -100]]),
    }
    tokens, samples = M.batch_counts(batch).tolist()[:2]
    assert tokens == 6 and samples == 3  # the mask wins over labels (3 + 2 + 1, padding not counted)


def test_count_tokens_without_mask_uses_labels_then_ids():
    no_mask = {"input_ids": torch.ones(2, 5, dtype=torch.long),
               "labels": torch.tensor([[-100, 1, 2, 3, -100], [-100, -100, 4, 5, 6]])}
    assert int(M.batch_counts(no_mask)[0]) == 6
    packed = {"input_ids": torch.ones(1, 7, dtype=torch.long)}
    assert int(M.batch_counts(packed)[0]) == 7
    # a 4-D (custom) mask is not a padding mask: fall back to the labels
    four_d = {"input_ids": torch.ones(1, 3, dtype=torch.long), "attention_mask": torch.ones(1, 1, 3, 3),
              "labels": torch.tensor([[-100, 1, 2]])}
    assert int(M.batch_counts(four_d)[0]) == 2


def test_token_counter_accumulates_micro_batches_on_the_batch_device():
    c = M.TokenCounter()
    assert int(c.tokens_tensor()) == 0
    c.add({"input_ids": torch.ones(2, 4, dtype=torch.long),
           "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])})
    c.add({"input_ids": torch.ones(3, 2, dtype=torch.long), "attention_mask": torch.tensor([[1, 0], [1, 1], [0, 0]])})
    t = c.tokens_tensor()
    assert isinstance(t, torch.Tensor) and t.dtype == torch.int64  # stays a tensor until someone reads it
    assert int(t) == 6 + 3 and c.samples == 4  # a row with no token is no sequence
    c.reset()
    assert int(c.tokens_tensor()) == 0 and c.samples == 0


def test_padding_free_rows_count_their_sequences_and_attention_over_each():
    """A flattened row is its sequences: 4 samples of 100 tokens, attention over 100 tokens each, not one
    sample whose attention spans 400."""
    from transformers import DataCollatorWithFlattening

    row = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": [1] * 100}] * 4)
    assert row["input_ids"].shape == (1, 400)
    tokens, samples, attended, squares = M.batch_counts(row).tolist()
    assert (tokens, samples, attended, squares) == (400, 4, 400, 4 * 100 ** 2)
    assert M.attention_length(attended, squares) == 100
    assert M.flops_per_token(0, 0, 4, 64, M.attention_length(attended, squares)) == 12 * 4 * 64 * 100


def test_padding_after_the_sequences_of_a_padded_flat_row_is_not_work():
    """TRL's padding-free collator pads the row to a multiple: zeros in position_ids after the last sequence."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    row = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=64)(
        [{"input_ids": [5] * 10}, {"input_ids": [6] * 7}])
    assert row["input_ids"].shape == (1, 64)
    assert M.batch_counts(row).tolist() == [17, 2, 17, 100 + 49]


def test_attention_length_weights_each_sequence_by_its_tokens():
    """Lengths 100 and 10: each of the 100 tokens attends over 100, each of the 10 over 10 -> S = 10100/110."""
    padded = {"input_ids": torch.ones(2, 100, dtype=torch.long),
              "attention_mask": torch.tensor([[1] * 100, [1] * 10 + [0] * 90])}
    tokens, samples, attended, squares = M.batch_counts(padded).tolist()
    assert (tokens, samples) == (110, 2) and M.attention_length(attended, squares) == pytest.approx(10100 / 110)
    # no mask, no positions: every row is as long as the batch, labels only say which tokens are work
    plain = {"input_ids": torch.ones(3, 8, dtype=torch.long), "labels": torch.full((3, 8), -100)}
    assert M.batch_counts(plain).tolist() == [0, 3, 24, 3 * 64]


def test_aggregate_ranks_sums_tokens_and_samples_and_maxes_memory():
    # RANK_FIELDS: tokens, samples, attended tokens, attended squares, peak allocated, peak reserved, allocated now
    rows = [[1000, 8, 1000, 9000, 5 << 30, 6 << 30, 4 << 30],
            [900, 8, 900, 8000, 7 << 30, 7 << 30, 3 << 30],
            [1100, 8, 1100, 7000, 6 << 30, 9 << 30, 5 << 30]]
    agg = M.aggregate_ranks(rows)
    assert agg["tokens"] == 3000 and agg["samples"] == 24
    assert agg["attended_tokens"] == 3000 and agg["attended_squares"] == 24000
    assert agg["peak_memory_allocated_bytes"] == 7 << 30
    assert agg["peak_memory_reserved_bytes"] == 9 << 30
    assert agg["memory_allocated_bytes"] == 5 << 30
    assert M.aggregate_ranks([[5, 1, 5, 25, 10, 10, 10]])["tokens"] == 5


# -------------------------------------------------------------------------------------- parameters
def test_parameter_counts_of_tiny_llama_match_hand_count(tiny_model):
    pc = parameter_counts(tiny_model)
    assert pc.total == TINY_TOTAL and pc.trainable == TINY_TOTAL
    assert pc.embedding == TINY_EMBEDDING
    assert pc.matmul_trainable == TINY_NON_EMBEDDING and pc.matmul_frozen == 0
    assert M.attention_dims(tiny_model) == (4, 64)


def test_tied_output_head_counts_once_as_a_matmul():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    pc = parameter_counts(model)
    assert pc.total == TINY_TOTAL - TINY_EMBEDDING  # one shared 512x64 matrix
    assert pc.embedding == 0  # it is the lm_head's matmul weight too
    assert pc.matmul_trainable == TINY_NON_EMBEDDING


def test_frozen_parameters_are_split_out(tiny_model):
    for name, p in tiny_model.named_parameters():
        p.requires_grad = name.startswith("lm_head")
    pc = parameter_counts(tiny_model)
    assert pc.trainable == 32_768 and pc.matmul_trainable == 32_768
    assert pc.matmul_frozen == TINY_NON_EMBEDDING - 32_768
    assert pc.embedding == TINY_EMBEDDING and pc.total == TINY_TOTAL


# ------------------------------------------------------------------------------------- FLOPs / MFU
def test_flops_per_token_full_fine_tune_by_hand():
    # 6 * 180800 + 12 * L=4 * H=64 * S=60 = 1_084_800 + 184_320
    assert M.flops_per_token(TINY_NON_EMBEDDING, 0, 4, 64, 60) == 1_269_120.0
    # no attention term when the shape is unknown
    assert M.flops_per_token(TINY_NON_EMBEDDING, 0, None, None, 60) == 1_084_800.0


def test_flops_per_token_frozen_base_by_hand():
    # lm_head trainable (32768), the rest frozen: 4 * 148032 + 6 * 32768 + 184320
    assert M.flops_per_token(32_768, TINY_NON_EMBEDDING - 32_768, 4, 64, 60) == 592_128 + 196_608 + 184_320


def test_flops_per_token_of_a_real_lora_model(tiny_model):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                           lora_dropout=0.0))
    pc = parameter_counts(model)
    # adapters per layer: q 8*64 + 64*8 = 1024, v 8*64 + 32*8 = 768 -> 1792, x4 layers
    assert pc.matmul_trainable == 4 * 1792 == pc.trainable
    assert pc.matmul_frozen == TINY_NON_EMBEDDING
    assert M.attention_dims(model) == (4, 64)
    fpt = M.flops_per_token(pc.matmul_trainable, pc.matmul_frozen, 4, 64, 60)
    assert fpt == 4 * 180_800 + 6 * 7_168 + 184_320 == 950_528


def test_mfu_by_hand_and_null_when_peak_unknown():
    # 1000 tok/s * 1.26912e6 FLOP/tok over 8 H100s of 989e12
    assert M.mfu(1000.0, 1_269_120.0, 989e12, 8) == pytest.approx(1.26912e9 / (8 * 989e12), rel=1e-12)
    # the MFU a Llama-7B-like run would show: 6.5e9 params, 3000 tok/s/GPU on one H100
    assert M.mfu(3000.0, 6 * 6.5e9, 989e12, 1) == pytest.approx(0.1183, abs=1e-4)
    assert M.mfu(1000.0, 1e6, None, 1) is None
    assert M.mfu(None, 1e6, 989e12, 1) is None


def test_compute_dtype_follows_args_then_weights():
    class Args:
        bf16 = False
        fp16 = False

    a = Args()
    assert M.compute_dtype(a, nn.Linear(2, 2), "cpu") == "fp32"
    a.bf16 = True
    assert M.compute_dtype(a, nn.Linear(2, 2), "cuda") == "bf16"
    assert M.compute_dtype(None, nn.Linear(2, 2).to(torch.float16), "cuda") == "fp16"


def test_fp32_with_tf32_on_is_tf32(tf32_restored):
    """fp32 matmuls with TF32 on are counted at the TF32 peak: at the fp32 peak (~7x lower on an H100)
    MFU would read ~7x too high."""
    from hf_speedup.compat import set_tf32

    set_tf32(True)
    assert M.compute_dtype(None, nn.Linear(2, 2), "cuda") == "tf32"
    assert M.compute_dtype(None, nn.Linear(2, 2), "cpu") == "fp32"
    set_tf32(False)
    assert M.compute_dtype(None, nn.Linear(2, 2), "cuda") == "fp32"


# ------------------------------------------------------------------------------------- peak FLOP/s
@pytest.mark.parametrize("name,dtype,expected", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA H100 NVL", "bf16", 835e12),
    ("NVIDIA H200 NVL", "bf16", 835e12),  # not the SXM part's 989e12
    ("NVIDIA H200", "bf16", 989e12),
    ("NVIDIA GH200 480GB", "bf16", 989e12),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312e12),
    ("NVIDIA A100-SXM4-40GB", "tf32", 156e12),
    ("NVIDIA A10G", "bf16", 70e12),
    ("NVIDIA A10", "bf16", 125e12),
    ("NVIDIA L4", "bf16", 121e12),
    ("NVIDIA L40S", "bf16", 362e12),
    ("NVIDIA GeForce RTX 4090", "bfloat16", 165.2e12),
    ("Tesla V100-SXM2-16GB", "bf16", None),  # no bf16 on Volta
    ("Tesla T4", "fp16", 65e12),
    ("NVIDIA RTX A4000", "bf16", None),  # not an A40
    ("AMD Instinct MI300X", "bf16", 1307e12),
])
def test_peak_flops_table(name, dtype, expected):
    assert peak_flops_for(name, dtype) == expected


def test_peak_flops_override_and_cpu(monkeypatch):
    monkeypatch.delenv(OVERRIDE_ENV, raising=False)
    assert resolve_peak_flops("cpu", "AMD EPYC", "fp32")[0] is None
    assert resolve_peak_flops("cuda", "NVIDIA H100 80GB HBM3", "bf16") == (989e12, "table")
    assert resolve_peak_flops("cuda", "Mystery GPU", "bf16")[0] is None
    monkeypatch.setenv(OVERRIDE_ENV, "1.5e12")
    assert resolve_peak_flops("cpu", "AMD EPYC", "fp32") == (1.5e12, "override")
    assert resolve_peak_flops("cuda", "NVIDIA H100 80GB HBM3", "bf16") == (1.5e12, "override")
    monkeypatch.setenv(OVERRIDE_ENV, "fast")
    with pytest.raises(ValueError, match=f"{OVERRIDE_ENV} = 'fast' is not allowed; allowed: a positive number"):
        resolve_peak_flops("cuda", "NVIDIA H100", "bf16")


# ------------------------------------------------------------------------------- steady state etc.
def test_steady_state_excludes_warmup_steps():
    times = [30.0, 0.2, 0.21, 5.0, 0.19, 0.2]  # step 1 and step 4 compiled
    assert M.steady_state_step_time(times, {0, 3}) == (0.2, 4)
    assert M.steady_state_step_time([3.0], {0}) == (3.0, 0)  # only warm-up: its median, flagged by 0 steps
    assert M.steady_state_step_time([], ()) == (None, 0)


def test_bounded_series_halves_resolution_and_keeps_the_start():
    s = M.BoundedSeries(max_len=8)
    for i in range(1000):
        s.append(i)
    assert len(s) <= 8 and s.items[0] == 0
    assert s.items == sorted(s.items) and s.items[-1] >= 1000 - 2 * s.stride
    gaps = {b - a for a, b in zip(s.items, s.items[1:])}
    assert gaps == {s.stride}  # evenly spaced


def test_memory_snapshot_on_cpu_is_peak_rss():
    snap = M.memory_snapshot("cpu")
    peak = snap["peak_memory_allocated_bytes"]
    assert peak == snap["peak_memory_reserved_bytes"] >= snap["memory_allocated_bytes"] > 0
    assert M.memory_source("cpu") == "process peak RSS"


# ------------------------------------------------------------------------------------------ compile
class _Breaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        torch._dynamo.graph_break()
        return y.relu()


def test_dynamo_counters_see_compiles_recompiles_and_graph_breaks():
    torch._dynamo.reset()
    before = M.dynamo_snapshot()
    events0 = M.compile_events()
    m = _Breaky()
    m.compile(backend="eager", dynamic=False)
    for n in (2, 2, 3):  # a new batch size with dynamic=False: every frame recompiles once
        m(torch.randn(n, 8)).sum().backward()
    diff = M.dynamo_diff(before, M.dynamo_snapshot())
    assert diff["frames"] >= 2 and diff["recompiles"] >= 1
    assert diff["graph_breaks"] >= 1
    assert diff["compile_seconds"] > 0
    assert M.compile_events() > events0
    torch._dynamo.reset()


def test_compiled_regions_counts_in_place_and_wrapped_modules(tiny_model):
    assert M.compiled_regions(tiny_model) == 0
    layers = tiny_model.model.layers
    for layer in layers[:3]:
        layer.compile(backend="eager")  # in place (nn.Module.compile)
    layers[3] = torch.compile(layers[3], backend="eager")  # wrapper (OptimizedModule)
    assert M.compiled_regions(tiny_model) == 4
    assert M.compiled_regions(tiny_model, tiny_model) == 4  # each module once
    assert M.compiled_regions(torch.compile(nn.Linear(2, 2), backend="eager")) == 1


def test_model_flops_per_second_and_fraction_of_a_peak_by_hand():
    from hf_speedup.report.measure import fraction_of_peak, model_flops_per_second

    assert model_flops_per_second(1000.0, 6e8) == 6e11
    assert model_flops_per_second(None, 6e8) is None and model_flops_per_second(1000.0, None) is None
    assert fraction_of_peak(6e11, 1e12) == pytest.approx(0.6)
    assert fraction_of_peak(6e11, 1e12, num_devices=2) == pytest.approx(0.3)  # the peak is per device
    assert fraction_of_peak(6e11, None) is None and fraction_of_peak(None, 1e12) is None


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "tf32"])
def test_the_matmul_peak_times_a_gemm_in_the_runs_dtype(dtype):
    """A small GEMM stands in for the large one: a positive FLOP/s and the library that gave it."""
    from hf_speedup.report.measure.matmul_peak import time_matmul_peak

    flops, library = time_matmul_peak("cpu", dtype, size=64, reps=1)
    assert flops > 0 and library in ("torch.mm", "oneDNN matmul")
    if dtype == "bf16":
        assert library == "torch.mm"  # a bf16 matmul, as autocast runs it


def test_the_matmul_peak_is_the_best_this_machine_showed_per_dtype_and_null_with_a_reason(monkeypatch, tmp_path):
    from hf_speedup import measured
    from hf_speedup.report.measure.matmul_peak import matmul_peak

    monkeypatch.setenv(measured.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(measured.MEASURE_ENV, "1")
    calls, busy = [], [1.0]

    def timer(device_type, dtype, size):
        calls.append(dtype)
        return {"fp32": 1e11, "bf16": 3e11}[dtype] * busy[0], "fake"

    assert matmul_peak("cpu", "EPYC", "fp32", 2, measure=timer)[0] == 1e11
    assert matmul_peak("cpu", "EPYC", "bf16", 2, measure=timer)[0] == 3e11
    assert matmul_peak("cpu", "EPYC", "fp32", 2, measure=timer)[0] == 1e11  # timed once per process
    assert calls == ["fp32", "bf16"]
    monkeypatch.setattr(measured, "_CEILINGS_TIMED", {})  # a new process (a later run) times again
    busy[0] = 0.4  # timed again while the machine is shared: the earlier, higher figure stays the ceiling
    value, source = matmul_peak("cpu", "EPYC", "fp32", 2, measure=timer)
    assert value == 1e11 and source.endswith("(cached)") and "EPYC, 2 threads" in source
    busy[0] = 1.5  # a quieter moment than before: the new figure becomes the ceiling
    monkeypatch.setattr(measured, "_CEILINGS_TIMED", {})
    value, source = matmul_peak("cpu", "EPYC", "fp32", 2, measure=timer)
    assert value == 1.5e11 and not source.endswith("(cached)")
    assert matmul_peak("cpu", "EPYC", "fp32", 1, measure=timer)[0] == 1.5e11  # 1 thread: its own entry
    assert calls == ["fp32", "bf16", "fp32", "fp32", "fp32"]
    monkeypatch.setenv(measured.MEASURE_ENV, "0")
    assert matmul_peak("cpu", "EPYC", "fp32", 2, measure=timer) == (None, "matmul peak not measured "
                                                                          "(HF_SPEEDUP_MEASURE=0)")
    monkeypatch.setenv(measured.MEASURE_ENV, "1")
    assert matmul_peak("mps", "Apple", "fp32", 1, measure=timer) == (None, "matmul peak not measured on mps "
                                                                           "(CPU and CUDA only)")
