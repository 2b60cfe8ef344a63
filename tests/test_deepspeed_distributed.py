"""Two CPU processes under DeepSpeed ZeRO-2 and ZeRO-3 (gloo): the stock Trainer and SpeedupTrainer with baseline,
auto, fast, memory and lora on the same tiny model, data and shipped DeepSpeed config. Each preset trains with the
stock Trainer's losses (lora: its own, falling), the report names DeepSpeed with the engine's live stage and, under
ZeRO-3, every parameter partitioned; compile stays off under ZeRO-3 with no graph break or recompile. Each preset
also saves every 2 steps (crash-safe: staged, then renamed into place; DeepSpeed's per-rank ``global_step*``
layout inside) and a second trainer resumes from checkpoint-2 with the uninterrupted run's losses, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from distributed_helpers import DIST, ROOT, distributed_marks, executable, launch, launch_env

pytest.importorskip("deepspeed")
pytestmark = distributed_marks()
PRESETS = ("baseline", "auto", "fast", "memory", "lora")
SAME_LOSSES = ("baseline", "auto", "fast", "memory")


@pytest.fixture(scope="session")
def torch_extensions(tmp_path_factory) -> dict:
    """DeepSpeed compiles a small C++ shared-memory op on its first CPU run (about 80 s): built once here, in one
    process, into a folder every launch of the session shares (``TORCH_EXTENSIONS_DIR``; kept where it is set)."""
    folder = os.environ.get("TORCH_EXTENSIONS_DIR") or str(tmp_path_factory.mktemp("torch_extensions"))
    env = {**launch_env(), "TORCH_EXTENSIONS_DIR": folder}
    build = ("from deepspeed.accelerator import get_accelerator; "
             "get_accelerator().create_op_builder('ShareMemCommBuilder').load()")
    subprocess.run([sys.executable, "-c", build], cwd=ROOT, env=env, check=True, capture_output=True, timeout=600)
    return {"TORCH_EXTENSIONS_DIR": folder}


@pytest.mark.parametrize("stage", [2, 3])
def test_presets_train_under_zero_as_the_stock_trainer_does(stage, tmp_path, torch_extensions):
    config = ROOT / "configs" / "deepspeed" / f"zero{stage}.json"
    launch([executable("torchrun"), "--standalone", "--nproc_per_node", "2", str(DIST / "deepspeed_train.py"),
            "--config", str(config), "--presets", *PRESETS, "--resume", "--out", str(tmp_path)], env=torch_extensions)
    results = json.loads((tmp_path / "results.json").read_text())
    stock = results["stock"]
    assert stock["deepspeed_enabled"] and stock["world_size"] == 2 and stock["stage"] == stage
    for preset in PRESETS:
        res = results[preset]
        assert res["deepspeed_enabled"] and res["world_size"] == 2 and res["stage"] == stage, preset
        entry = res["plan"]["deepspeed"]
        assert entry["applied"] == f"zero-{stage}" and entry["engaged"] is True, (preset, entry)
        assert f"engine at ZeRO stage {stage} on 2 process(es)" in entry["reason"], preset
        assert entry["settings"]["live_stage"] == stage and entry["settings"]["world_size"] == 2
        if stage == 3:
            done, total = entry["settings"]["partitioned_parameters"].split("/")
            assert done == total, (preset, entry["settings"])
            assert res["plan"]["compile"]["applied"] == "off", preset
        assert res["metrics"]["graph_breaks"] == 0 and res["metrics"]["recompiles"] == 0, (preset, res["metrics"])
        if preset in SAME_LOSSES:
            assert res["losses"] == pytest.approx(stock["losses"], rel=1e-5, abs=1e-5), preset
        resumed = results[f"{preset}:resumed"]
        assert resumed["losses"] == res["losses"], preset  # steps 3-4 after the resume: bit for bit
        assert {"global_step2", "latest", "trainer_state.json"} <= set(resumed["checkpoint"]), resumed["checkpoint"]
        crash_safe = resumed["plan"]["crash_safe"]
        assert crash_safe["engaged"] is True and crash_safe["settings"]["resumed_from"].endswith("checkpoint-2")
    lora = list(results["lora"]["losses"].values())
    assert len(lora) == 4 and lora[-1] < lora[0]
    if stage == 2:  # ZeRO-2 leaves the modules alone: fast's regional compile stays planned
        assert results["fast"]["plan"]["compile"]["applied"].startswith("blocks:"), results["fast"]["plan"]["compile"]
