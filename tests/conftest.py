"""Shared fixtures: tiny Llama-style models from a config, a local tokenizer, data made at run time."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# plans decide from capability flags unless a test measures (tests/test_measured.py): a timing at the door would
# make a test's plan depend on how busy this machine is; measurements go to a throw-away cache
os.environ.setdefault("HF_SPEEDUP_MEASURE", "0")
os.environ.setdefault("HF_SPEEDUP_CACHE_DIR", tempfile.mkdtemp(prefix="hf_speedup_cache_"))

from hf_speedup.hardware import BITSANDBYTES_ON_CPU  # noqa: E402  (after the environment it must see)

import fake_cpu  # noqa: E402

fake_cpu.install()  # HF_SPEEDUP_FAKE_CPU_AMX plans as that CPU kind (the cpu_kind fixture, or the whole suite)


@pytest.fixture(scope="session")
def tokenizer():
    from hf_speedup.tiny import char_tokenizer

    return char_tokenizer()


@pytest.fixture(scope="session")
def dataset(tokenizer):
    """256 packed rows; a list of rows where the ``datasets`` package is missing (the GPU machine's image)."""
    from hf_speedup.tiny import make_rows

    return make_rows(tokenizer, n=256, seed=0, pack_to=64)


@pytest.fixture
def tiny_model():
    """4 blocks, hidden 64: small enough that a training step takes milliseconds."""
    from hf_speedup.tiny import tiny_llama

    return tiny_llama(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture
def collator(tokenizer):
    from hf_speedup.tiny import causal_lm_collator

    return causal_lm_collator(tokenizer)


@pytest.fixture
def make_args(tmp_path):
    """TrainingArguments for a short CPU run; keyword arguments override."""
    from transformers import TrainingArguments

    def _make(**kw):
        base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=3,
                    logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", seed=0,
                    dataloader_num_workers=0, disable_tqdm=True)
        base.update(kw)
        return TrainingArguments(**base)

    return _make


def fake_caps(**kw):
    """Capabilities of a machine we are not on (CUDA H100, CPU without bitsandbytes, multi-process...)."""
    from hf_speedup.hardware import Capabilities

    return Capabilities(**kw)


CUDA_H100 = dict(device_type="cuda", device_name="NVIDIA H100 80GB HBM3", device_count=1, compute_capability=(9, 0),
                 bf16=True, fp16=True, tf32=True, fused_adamw=True, bitsandbytes=True, compile=True)
CUDA_V100 = dict(device_type="cuda", device_name="Tesla V100-SXM2-16GB", device_count=1, compute_capability=(7, 0),
                 bf16=False, fp16=True, tf32=False, fused_adamw=True, bitsandbytes=True, compile=True)
CPU_NO_BF16 = dict(device_type="cpu", device_name="AMD EPYC", bf16=False, bitsandbytes=False, compile=True,
                   bitsandbytes_reason=BITSANDBYTES_ON_CPU)
CPU_AMX = dict(device_type="cpu", device_name="Intel Xeon (Sapphire Rapids)", bf16=True, bitsandbytes=False, compile=True)


# baseline's numerics with the report written, sent to the trackers and printed (baseline itself keeps output_dir,
# the trackers and stdout as the stock Trainer leaves them)
REPORTED_BASELINE = {"base": "baseline", "name": "baseline",
                     "report": {"path": "auto", "trackers": True, "console": True}}


def _tracker_logs_class():
    from transformers import TrainerCallback

    class TrackerLogs(TrainerCallback):
        """A stand-in ``report_to`` tracker: keeps every log its ``on_log`` is given."""

        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs or {}))

    return TrackerLogs


TrackerLogs = _tracker_logs_class()


def tracking(*classes):
    """Within it, hf_speedup treats ``classes`` as ``report_to`` trackers (as transformers' W&B or TensorBoard
    callbacks are): they get the hf_speedup metrics in their ``on_log``."""
    from unittest import mock

    return mock.patch("hf_speedup.callback_handler.tracker_classes", lambda: classes)


# Both CPU decision paths on whichever CPU runs the suite: `auto` picks bf16 autocast on a CPU with AMX
# and fp32 elsewhere. bf16 autocast runs on every x86 CPU (slowly without AMX), so both paths really train.
CPU_KINDS = {"cpu-fp32": False, "cpu-amx": True}
# Loss tolerance for two runs in the same compute dtype (like with like): fp32 runs differ only by
# reduction order; bf16 autocast rounds GEMM inputs to 8 mantissa bits (unit roundoff 2**-8 = 3.9e-3).
SAME_DTYPE_LOSS_REL = {"fp32": 1e-4, "bf16": 2e-3}
# Loss tolerance of a bf16-autocast run against an fp32 one (a preset that picked bf16 against baseline), at every
# logged step of a loss curve, relative: bf16 rounds every GEMM input to 8 mantissa bits, and over a curve the
# weights themselves drift apart by the rounding of every update, so allow ~5 unit roundoffs (5 x 2**-8 = 2e-2).
BF16_VS_FP32_LOSS_REL = 2e-2


def assert_same_in_dtype(actual, expected, dtype: str, name: str = "") -> None:
    """Two gradients of one step computed in the same compute dtype agree.

    fp32: elementwise (rtol 1e-3). bf16: per tensor, ||a - b|| / ||b|| <= 3e-2 (~8 roundings of 2**-8):
    where bf16 rounding happens differs between eager and a fused compile (measured 1.4e-2), so only
    wiring errors (O(1) differences) are visible in bf16; the fp32 path checks the math tightly.
    """
    import torch

    if dtype == "fp32":
        torch.testing.assert_close(actual, expected, rtol=1e-3, atol=1e-5, msg=name)
        return
    rel = ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)).item()
    assert rel <= 3e-2, f"{name}: relative difference {rel:.2e} > 3e-2 in {dtype}"


@pytest.fixture(params=sorted(CPU_KINDS))
def cpu_kind(request, monkeypatch):
    """Fake the CPU's bf16 capability (AMX or not), so tests exercise both precision paths anywhere; through
    the environment, so the scripts of tests/dist a test launches (torchrun, accelerate launch) plan for the same
    CPU (tests/fake_cpu.py, applied by their dist_common)."""
    from fake_cpu import FAKE_CPU_AMX

    monkeypatch.setenv(FAKE_CPU_AMX, "1" if CPU_KINDS[request.param] else "0")
    return request.param


@pytest.fixture
def tf32_restored():
    """TF32 is process-wide torch state: put both API generations back as they were."""
    from fake_gpu import tf32_restore, tf32_snapshot

    state = tf32_snapshot()
    yield
    tf32_restore(state)


@pytest.fixture
def allocator_restored():
    """The caching-allocator settings are process-wide: expandable_segments back to what it was."""
    from hf_speedup.compat import get_allocator_settings, set_allocator_settings

    before = get_allocator_settings()
    yield
    set_allocator_settings("expandable_segments:True" if before and "expandable_segments:true" in before.lower()
                           else "expandable_segments:False")


@pytest.fixture
def gpu_host(monkeypatch, tf32_restored, allocator_restored):
    """This machine as a host with one H100 (tests/fake_gpu.py), up to the first real CUDA call."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a real GPU is here: the gpu tests check the real thing")
    import bitsandbytes  # noqa: F401  (imported on the real, CUDA-less torch before it is faked)
    import peft  # noqa: F401

    from fake_gpu import GpuHost, clear_device_caches

    clear_device_caches()  # transformers caches what it found of this machine: it is another one now
    yield GpuHost().install(monkeypatch)
    clear_device_caches()


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly on machines without CUDA (CI never has one)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def one_process_losses(tmp_path_factory):
    """The losses of tests/dist/fsdp_train.py's run in this process: the whole global batch, FSDP off (one process),
    what a sharded run of the same data must reproduce. Computed once per session."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
    import fsdp_train

    losses, decision, _ = fsdp_train.reference_losses(tmp_path_factory.mktemp("one_process"))
    assert decision["applied"] == "off"
    return losses


def fake_matmul_peak(monkeypatch, cache_dir, flops: float = 5e9) -> list:
    """Measuring on, with this machine's matmul peak timed by a fake GEMM (``flops`` FLOP/s) and cached in
    ``cache_dir``: the report's ``matmul_peak_flops_per_second`` and ``fraction_of_matmul_peak`` are numbers.
    Returns the list of (device type, dtype, size) timed."""
    from hf_speedup import measured
    from hf_speedup.report import model_facts
    from hf_speedup.report.measure.matmul_peak import matmul_peak

    monkeypatch.setenv(measured.MEASURE_ENV, "1")
    monkeypatch.setenv(measured.CACHE_ENV, str(cache_dir))
    monkeypatch.setenv("HF_SPEEDUP_FAKE_CPU_AMX", "0")  # the plan's dtype from the flag, not from a timing
    timed: list = []

    def fake_timer(device_type, dtype, size):
        timed.append((device_type, dtype, size))
        return flops, "fake GEMM"

    monkeypatch.setattr(model_facts, "matmul_peak", lambda *a, **k: matmul_peak(*a, **k, measure=fake_timer))
    return timed


@pytest.fixture(scope="session")
def torch_extensions(tmp_path_factory) -> dict:
    """DeepSpeed compiles a small C++ shared-memory op on its first CPU run (about 80 s): built once here, in one
    process, into a folder every launch of the session shares (``TORCH_EXTENSIONS_DIR``; kept where it is set)."""
    folder = os.environ.get("TORCH_EXTENSIONS_DIR") or str(tmp_path_factory.mktemp("torch_extensions"))
    from distributed_helpers import ROOT, launch_env

    env = {**launch_env(), "TORCH_EXTENSIONS_DIR": folder}
    build = ("from deepspeed.accelerator import get_accelerator; "
             "get_accelerator().create_op_builder('ShareMemCommBuilder').load()")
    subprocess.run([sys.executable, "-c", build], cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    return {"TORCH_EXTENSIONS_DIR": folder}
