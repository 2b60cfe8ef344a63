"""The compile cache travels with the run: saved beside each checkpoint, loaded before a resumed run's first compile,
ignored with the reason when it is foreign or corrupted, and weighed by ``compile.when: pays_back``.

The slow test runs inductor for real in fresh processes (each with an empty ``TORCHINDUCTOR_CACHE_DIR``) and reads
the hits off torch's own counters. The others check the wiring with the ``eager`` backend, where torch has no cache
artifacts: ``torch.compiler.save_cache_artifacts`` is stood in for by a payload that is valid (no entries) or not.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from distributed_helpers import launch_env
from hf_speedup import SpeedupConfigError, SpeedupTrainer, get_preset
from hf_speedup.features.compile import cache, payback

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "dist" / "compile_cache_train.py"


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _empty_artifacts() -> bytes:
    """torch's portable cache format holding no entries (what a real payload looks like to the loader)."""
    from torch.compiler._cache import _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    return AppendingByteSerializer(serialize_fn=_serialize_single_cache).to_bytes()


def _stand_in(monkeypatch, payload: bytes) -> None:
    info = SimpleNamespace(artifacts={"inductor": ["a-graph"]})
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (payload, info))


def _config(**compile):
    return get_preset("baseline").replace(compile={"enabled": True, "backend": "eager", "mode": None, **compile})


def _trainer(model, make_args, dataset, collator, steps=2, **compile):
    return SpeedupTrainer(model=model, args=make_args(max_steps=steps, save_strategy="steps", save_steps=2),
                          train_dataset=dataset, data_collator=collator, speedup=_config(**compile))


def _tiny():
    from hf_speedup.tiny import tiny_llama

    return tiny_llama(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


# --------------------------------------------------------------------------------------------- wiring (eager)
def test_saved_into_the_checkpoint_and_loaded_by_the_run_resumed_from_it(make_args, dataset, collator, monkeypatch):
    _stand_in(monkeypatch, _empty_artifacts())
    first = _trainer(_tiny(), make_args, dataset, collator, steps=2)
    first.train()
    checkpoint = Path(first.args.output_dir) / "checkpoint-2"
    header = json.loads((checkpoint / cache.HEADER).read_text())
    assert header["torch"] == torch.__version__ and header["device_type"] == "cpu" and header["step"] == 2
    assert header["model"]["config"] == "LlamaConfig" and header["compile"]["backend"] == "eager"
    saved = first.speedup_status["compile"].facts["cache_saved"]
    assert saved["path"] == str(checkpoint) and saved["bytes"] == (checkpoint / cache.FILE).stat().st_size > 0

    resumed = _trainer(_tiny(), make_args, dataset, collator, steps=4)
    resumed.train(resume_from_checkpoint=True)
    facts = resumed.speedup_report.to_dict()["plan"]["compile"]["settings"]
    assert facts["cache_loaded"] is True and facts["cache_source"] == str(checkpoint)
    assert "compile cache loaded from" in resumed.speedup_status["compile"].reason
    assert facts["cache_hits"] == 0  # eager compiles nothing inductor could have cached: nothing counted as a hit


def test_none_saves_and_loads_nothing(make_args, dataset, collator, monkeypatch):
    _stand_in(monkeypatch, _empty_artifacts())
    trainer = _trainer(_tiny(), make_args, dataset, collator, steps=2, cache_dir="none")
    trainer.train()
    assert not (Path(trainer.args.output_dir) / "checkpoint-2" / cache.HEADER).exists()
    assert cache.write_into(trainer, str(Path(trainer.args.output_dir) / "elsewhere")) is None
    facts = trainer.speedup_status["compile"].facts
    assert facts["cache_loaded"] is False and "compile.cache_dir = none" in facts["cache_reason"]


def _corrupt_torch(folder: Path) -> None:
    header = json.loads((folder / cache.HEADER).read_text())
    header["torch"] = "1.0.0"
    (folder / cache.HEADER).write_text(json.dumps(header))


def _flip_bytes(folder: Path) -> None:
    data = bytearray((folder / cache.FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / cache.FILE).write_bytes(bytes(data))


def _truncate_header(folder: Path) -> None:
    text = (folder / cache.HEADER).read_text()
    (folder / cache.HEADER).write_text(text[: len(text) // 2])


@pytest.mark.parametrize("payload, spoil, reason", [
    (b"", _corrupt_torch, r"ignored: written by torch 1\.0\.0 \(this is torch 2\.\S+\); the blocks compile cold"),
    (b"", _flip_bytes, r"ignored: compile_cache\.bin is corrupted \(\d+ bytes, its checksum differs"),
    (b"", _truncate_header, r"ignored: compile_cache\.json is corrupted \(JSONDecodeError"),
    (b"not torch's format", None, r"ignored: compile_cache\.bin is corrupted \(torch could not read its cache artifacts"),
], ids=["other-torch", "flipped-bytes", "truncated-header", "unreadable-artifacts"])
def test_a_foreign_or_corrupted_cache_is_ignored_with_the_reason(make_args, dataset, collator, monkeypatch, caplog,
                                                                 tmp_path, payload, spoil, reason):
    folder = tmp_path / "compile-cache"
    _stand_in(monkeypatch, payload or _empty_artifacts())
    _trainer(_tiny(), make_args, dataset, collator, steps=1, cache_dir=str(folder)).train()  # written at train end
    assert (folder / cache.HEADER).is_file()
    if spoil is not None:
        spoil(folder)
    with caplog.at_level(logging.WARNING, logger="hf_speedup"):
        again = _trainer(_tiny(), make_args, dataset, collator, steps=2, cache_dir=str(folder))
        again.train()
    assert again.state.global_step == 2  # never a crash
    entry = again.speedup_report.to_dict()["plan"]["compile"]
    assert entry["settings"]["cache_loaded"] is False
    assert re.search(reason, entry["settings"]["cache_reason"]), entry["settings"]["cache_reason"]
    assert re.search(reason, entry["reason"])  # in the report's notes
    assert any(re.search(reason, r.getMessage()) for r in caplog.records)  # and logged


def test_a_cache_of_another_model_is_ignored(make_args, dataset, collator, monkeypatch, tmp_path):
    from hf_speedup.tiny import tiny_llama

    folder = tmp_path / "compile-cache"
    _stand_in(monkeypatch, _empty_artifacts())
    _trainer(_tiny(), make_args, dataset, collator, steps=1, cache_dir=str(folder)).train()
    wider = tiny_llama(seed=0, hidden_size=64, intermediate_size=192, num_attention_heads=4, num_key_value_heads=2)
    other = _trainer(wider, make_args, dataset, collator, steps=1, cache_dir=str(folder))
    other.train()
    assert re.search(r"ignored: written for another model \(regions '\w+' here '\w+'\)",
                     other.speedup_status["compile"].facts["cache_reason"])


def test_bad_cache_dir_is_named_with_the_allowed_values():
    with pytest.raises(SpeedupConfigError, match=r"compile\.cache_dir = 5 is not allowed; allowed: 'auto' .*'none' "
                                                 r".*a folder path .*fix: e\.g\. compile\.cache_dir: auto"):
        get_preset("fast").replace(compile={"cache_dir": 5})


@pytest.mark.parametrize("recorded, expected", [
    ({"cold_compile_seconds": 40.0, "cached_compile_seconds": None}, 40.0 * cache.CACHED_SHARE),
    ({"cold_compile_seconds": 40.0, "cached_compile_seconds": 3.0}, 3.0),
], ids=["estimated-from-the-cold-compile", "measured-by-a-cached-run"])
def test_pays_back_weighs_the_compile_from_the_loaded_cache(make_args, dataset, collator, monkeypatch, tmp_path,
                                                             recorded, expected):
    folder = tmp_path / "compile-cache"
    _stand_in(monkeypatch, _empty_artifacts())
    _trainer(_tiny(), make_args, dataset, collator, steps=1, cache_dir=str(folder), dynamic=True).train()
    header = json.loads((folder / cache.HEADER).read_text())
    (folder / cache.HEADER).write_text(json.dumps({**header, **recorded}))
    monkeypatch.setitem(payback.PAYBACK, "cpu", (1e6, 500.0, 500.0))  # gain so large the gate opens
    run = _trainer(_tiny(), make_args, dataset, collator, steps=6, cache_dir=str(folder), when="pays_back", dynamic=True)
    run.train()
    state = run.speedup_status["compile"]
    assert state.facts["cache_loaded"] is True
    assert state.facts["payback_compile_cost_s"] == pytest.approx(expected, abs=1e-3)  # not the cold 500 s
    assert "against a compile from the compile cache loaded from" in state.reason


def test_a_fresh_run_weighs_the_cold_compile(make_args, dataset, collator, monkeypatch):
    monkeypatch.setitem(payback.PAYBACK, "cpu", (1e6, 500.0, 500.0))
    run = _trainer(_tiny(), make_args, dataset, collator, steps=6, when="pays_back", dynamic=True)
    run.train()
    facts = run.speedup_status["compile"].facts
    assert facts["cache_loaded"] is False and facts["payback_compile_cost_s"] == 500.0
    assert "a fresh run: no compile cache to load" in facts["cache_reason"]


# --------------------------------------------------------------------------------------------- inductor, new processes
def _run(out: Path, inductor_dir: Path, *args: str) -> dict:
    inductor_dir.mkdir()
    result = out.parent / f"{inductor_dir.name}.json"
    env = {**launch_env(), "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--json", str(result), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(result.read_text())


@pytest.mark.slow
def test_a_new_process_with_an_empty_inductor_cache_resumes_from_the_checkpoints_cache(tmp_path):
    out = tmp_path / "run"
    cold = _run(out, tmp_path / "inductor-cold", "--steps", "2")
    assert cold["engaged"], cold["reason"]
    assert cold["facts"]["cache_loaded"] is False and cold["fxgraph"].get("fxgraph_cache_miss", 0) > 0
    header = json.loads((out / "checkpoint-2" / cache.HEADER).read_text())
    assert header["entries"]["inductor"] > 0 and header["entries"]["kernels"] > 0  # the CPU kernels travel too
    assert header["cold_compile_seconds"] > 0

    resumed = _run(out, tmp_path / "inductor-resumed", "--steps", "8", "--resume", "--pays-back")
    facts = resumed["facts"]
    assert resumed["engaged"] and resumed["global_step"] == 8, resumed["reason"]
    assert facts["cache_loaded"] is True and facts["cache_source"] == str(out / "checkpoint-2")
    # torch's own counters: the graphs came from the cache, none was compiled from scratch
    assert facts["cache_hits"] > 0 and resumed["fxgraph"].get("fxgraph_cache_hit", 0) > 0
    assert facts["cache_graphs_compiled"] == resumed["fxgraph"].get("fxgraph_cache_miss", 0) == 0
    assert facts["cache_graphs_compiled"] < cold["facts"]["cache_graphs_compiled"]
    assert facts["compile_seconds_this_process"] > 0  # compiled from the cache: dynamo still traced the blocks
    # pays_back weighed the compile from the cache, estimated from the cold compile its header recorded
    assert facts["payback_compile_cost_s"] == pytest.approx(header["cold_compile_seconds"] * cache.CACHED_SHARE,
                                                            abs=1e-3)
    assert "against a compile from the compile cache loaded from" in resumed["reason"]
    # the checkpoints of the resumed run carry the cache on, with the compile it measured from the cache
    last = json.loads((out / "checkpoint-8" / cache.HEADER).read_text())
    assert last["entries"]["inductor"] >= header["entries"]["inductor"]
    assert last["cold_compile_seconds"] == header["cold_compile_seconds"] and last["cached_compile_seconds"] > 0
