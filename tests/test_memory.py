"""memory: torch_empty_cache_steps and expandable_segments on CUDA (honestly off on CPU); CPU malloc reuse."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import CPU_NO_BF16, CUDA_H100, fake_caps
from hf_speedup import SpeedupTrainer, get_preset
from hf_speedup.plan import plan_for as make_plan
from hf_speedup.config import SpeedupConfigError
from hf_speedup.compat import get_allocator_settings, set_allocator_settings
from hf_speedup.features import memory
from hf_speedup.plan_types import Outcome


def plan_for(caps: dict, preset: str = "memory", args=None):
    return make_plan(preset, caps=fake_caps(**caps), args=args)["memory"]


# ------------------------------------------------------------------------------------------ plan
def test_cuda_memory_preset_sets_empty_cache_steps_and_expandable_segments(make_args):
    d = plan_for(CUDA_H100)
    assert d.applied == "every 50 steps + expandable" and d.fallbacks == ()
    assert memory.training_args(d, make_args()) == {"torch_empty_cache_steps": 50}
    assert d.settings.expandable_segments is True


def test_cpu_reports_not_applicable_with_the_reason_and_changes_nothing(make_args):
    d = plan_for(CPU_NO_BF16)
    assert d.applied == "off" and "no CUDA caching allocator" in d.reason
    assert d.fallbacks and d.fallbacks[0].startswith("every 50 steps + expandable:")
    assert memory.training_args(d, make_args()) == {}
    assert memory.verify(d, SimpleNamespace(args=make_args()), Outcome())[0] is False


def test_off_keeps_the_users_own_empty_cache_steps(make_args):
    d = plan_for(CUDA_H100, "baseline", args=make_args(torch_empty_cache_steps=7))
    assert d.applied == "off" and memory.training_args(d, None) == {}
    assert "torch_empty_cache_steps=7 is kept" in d.reason


# ------------------------------------------------------------------------------------------ allocator env
def test_allocator_env_merges_with_settings_already_there():
    env = memory.allocator_env(True, {"PYTORCH_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:False"})
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True",
                   "PYTORCH_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"}
    # torch reads PYTORCH_CUDA_ALLOC_CONF first, so its value is the one that is extended
    env = memory.allocator_env(True, {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6",
                                      "PYTORCH_ALLOC_CONF": "max_split_size_mb:64"})
    assert env["PYTORCH_ALLOC_CONF"] == "garbage_collection_threshold:0.6,expandable_segments:True"
    assert memory.allocator_env(True, {}) == {v: "expandable_segments:True" for v in memory.ENV_VARS}


def test_memory_env_for_launchers_follows_the_preset():
    assert memory.memory_env("memory", {}) == {v: "expandable_segments:True" for v in memory.ENV_VARS}
    assert memory.memory_env("auto", {}) == {}


def test_enable_before_cuda_init_exports_env_and_sets_the_allocator(monkeypatch, allocator_restored):
    monkeypatch.setattr(memory, "cuda_initialized", lambda: False)
    env: dict = {}
    ok, how = memory.enable_expandable_segments(env)
    assert ok and env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" and "before CUDA" in how
    assert "expandable_segments:True" in get_allocator_settings()


def test_enable_after_cuda_init_sets_it_at_run_time_and_says_which_segments_it_reaches(gpu_host):
    """The probe of a GPU run initialises CUDA (torch read PYTORCH_CUDA_ALLOC_CONF then): the env is not
    pretended; the run-time setting reaches every segment reserved after it, none before it."""
    gpu_host.init()
    set_allocator_settings("expandable_segments:False")
    env: dict = {}
    ok, how = memory.enable_expandable_segments(env)
    assert ok and env == {}
    assert "before the first CUDA allocation: every segment is expandable" in how
    assert "expandable_segments:True" in get_allocator_settings()
    gpu_host.reserve(3 * 2**30, expandable=False)  # the model weights, moved to the GPU before the trainer
    ok, how = memory.enable_expandable_segments({})
    assert ok and "the 1 segment(s) reserved before now (3.00 GiB, e.g. the model weights) stay fixed-size" in how
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before launching" in how


def test_expandable_is_engaged_only_when_the_segments_reserved_after_it_are_expandable(gpu_host, make_args):
    """Reading the settings back is not enough: where the allocator keeps reserving fixed-size segments
    (a driver without virtual memory management, cudaMallocAsync) it is not engaged."""
    gpu_host.init()
    gpu_host.reserve(2**30, expandable=False)  # weights, before the setting
    d = plan_for(CUDA_H100)
    outcome = Outcome()
    memory.apply(d, None, outcome)
    trainer = SimpleNamespace(args=SimpleNamespace(torch_empty_cache_steps=50))
    engaged, reason = memory.verify(d, trainer, outcome)
    assert engaged is True and "0/0 segments reserved since the setting expandable (1 reserved before it" in reason
    gpu_host.reserve(2**29, expandable=False)  # the first step's activations: the setting did not take
    engaged, reason = memory.verify(d, trainer, outcome)
    assert engaged is False and "0/1 segments reserved since the setting expandable" in reason
    assert "NOT in force" in reason
    gpu_host.segments[-1]["is_expandable"] = True
    engaged, reason = memory.verify(d, trainer, outcome)
    assert engaged is True and "1/1 segments reserved since the setting expandable" in reason


def test_enabling_keeps_the_users_other_allocator_settings(monkeypatch, allocator_restored):
    """torch resets every allocator option a settings string leaves out: ours must carry the user's."""
    monkeypatch.setattr(memory, "cuda_initialized", lambda: True)
    set_allocator_settings("max_split_size_mb:256,garbage_collection_threshold:0.6")
    assert memory.enable_expandable_segments({})[0]
    assert get_allocator_settings() == "max_split_size_mb:256,garbage_collection_threshold:0.6,expandable_segments:True"
    set_allocator_settings("expandable_segments:False")  # as torch reads it when the env was exported late
    monkeypatch.setattr(memory, "get_allocator_settings", lambda: "")
    assert memory.enable_expandable_segments({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"})[0]
    assert get_allocator_settings() == "max_split_size_mb:128,expandable_segments:True"


def test_verify_reads_the_allocator_and_the_trainer_args(allocator_restored):
    d = plan_for(CUDA_H100)
    set_allocator_settings("expandable_segments:False")
    engaged, reason = memory.verify(d, SimpleNamespace(args=SimpleNamespace(torch_empty_cache_steps=50)), Outcome())
    assert engaged is False and "expandable_segments OFF" in reason
    set_allocator_settings("expandable_segments:True")
    engaged, reason = memory.verify(d, SimpleNamespace(args=SimpleNamespace(torch_empty_cache_steps=50)), Outcome())
    assert engaged is True and "args.torch_empty_cache_steps=50" in reason
    assert memory.verify(d, SimpleNamespace(args=SimpleNamespace(torch_empty_cache_steps=None)), Outcome())[0] is False


# ------------------------------------------------------------------------------------------ real objects
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU behaviour")
def test_memory_preset_on_cpu_is_reported_not_engaged(monkeypatch, tiny_model, dataset, collator, make_args):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=1), train_dataset=dataset,
                             data_collator=collator, speedup="memory")
    trainer.train()
    d = trainer.speedup_status["memory"]
    assert d.engaged is False and "no CUDA caching allocator" in d.to_dict()["reason"]
    assert trainer.args.torch_empty_cache_steps is None
    import os

    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # nothing set for an allocator that is not there


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_memory_preset_engages(tiny_model, dataset, collator, make_args, allocator_restored):
    cfg = get_preset("baseline").replace(memory={"empty_cache_steps": 2, "expandable_segments": True})
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=3, use_cpu=False), train_dataset=dataset,
                             data_collator=collator, speedup=cfg)
    trainer.train()
    d = trainer.speedup_status["memory"]
    assert d.engaged is True, d.engaged_reason
    assert trainer.args.torch_empty_cache_steps == 2
    assert torch.cuda.memory.get_allocator_backend() == "native"
    reached = re.search(r"(\d+)/(\d+) segments reserved since the setting expandable", d.engaged_reason)
    assert reached and int(reached.group(1)) > 0, d.engaged_reason  # training reserved expandable segments
    x = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # a new segment after the setting
    segments = torch.cuda.memory_snapshot()
    assert any(s.get("is_expandable") for s in segments), segments[:2]
    del x


# ------------------------------------------------------------------------------------------ CPU malloc reuse
GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"


def test_fast_on_cpu_plans_cpu_reuse_and_cuda_does_not():
    cpu = make_plan("fast", caps=fake_caps(**CPU_NO_BF16))["memory"]
    cuda = make_plan("fast", caps=fake_caps(**CUDA_H100))["memory"]
    assert cpu.requested == "cpu-reuse-freed" and cpu.settings.cpu_reuse_freed is GLIBC
    if GLIBC:
        assert cpu.applied == "cpu-reuse-freed" and cpu.reason == memory.CPU_REUSE_WHY and cpu.fallbacks == ()
    assert cuda.applied == "off" and cuda.settings.cpu_reuse_freed is False
    assert cuda.fallbacks == ("cpu-reuse-freed: not applied on cuda: tensors live in the device allocator, "
                              "not CPU malloc",)


def test_cpu_reuse_joins_the_cuda_knobs_reasons_on_cpu():
    cfg = get_preset("memory").replace(memory={"cpu_reuse_freed": True})
    d = make_plan(cfg, caps=fake_caps(**CPU_NO_BF16))["memory"]
    assert d.requested == "every 50 steps + expandable + cpu-reuse-freed"
    assert d.reason.startswith("not applicable on cpu: no CUDA caching allocator")
    if GLIBC:
        assert d.applied == "cpu-reuse-freed" and d.reason.endswith(memory.CPU_REUSE_WHY)


def test_without_glibc_cpu_reuse_falls_back_with_the_reason(monkeypatch):
    monkeypatch.setattr(platform, "libc_ver", lambda *a, **k: ("musl", "1.2"))
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    d = make_plan("fast", caps=fake_caps(**CPU_NO_BF16))["memory"]
    assert d.applied == "off" and d.settings.cpu_reuse_freed is False
    assert d.fallbacks == ("cpu-reuse-freed: needs glibc's mallopt; this Linux uses another C library (e.g. musl)",)
    assert memory.verify(d, SimpleNamespace(args=None), Outcome()) == (False, d.reason)


def test_cpu_reuse_must_be_a_bool():
    with pytest.raises(SpeedupConfigError, match=r"memory\.cpu_reuse_freed = 'yes' is not allowed; allowed: true, false"):
        get_preset("fast").replace(memory={"cpu_reuse_freed": "yes"})


PROBE = """
import json
from hf_speedup import cpu_allocator
before = cpu_allocator.reallocation_faults()
applied, how = cpu_allocator.reuse_freed_memory()
print(json.dumps({"before": before, "after": cpu_allocator.reallocation_faults(), "applied": applied, "how": how}))
"""


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_reuse_stops_page_faults_on_reallocation_in_a_fresh_process():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    (faults_before, pages), (faults_after, _) = res["before"], res["after"]
    assert faults_before >= pages // 2  # glibc's default unmaps a freed 40 MiB block: its pages fault in again
    assert faults_after == 0 and res["applied"] is True
    assert res["how"] == "glibc mallopt: M_MMAP_THRESHOLD=1024 MiB, M_TRIM_THRESHOLD=2 GiB"


@pytest.mark.skipif(not GLIBC or torch.cuda.is_available(), reason="CPU training with glibc")
def test_fast_preset_engages_cpu_reuse_verified_by_the_probe(tiny_model, dataset, collator, make_args):
    cfg = get_preset("baseline").replace(memory={"cpu_reuse_freed": True})
    trainer = SpeedupTrainer(model=tiny_model, args=make_args(max_steps=2), train_dataset=dataset,
                             data_collator=collator, speedup=cfg)
    trainer.train()
    d = trainer.speedup_status["memory"].to_dict()
    assert d["engaged"] is True and d["applied"] == "cpu-reuse-freed"
    assert "re-allocating a freed 40 MiB block faulted 0/10240 pages in again" in d["reason"]
