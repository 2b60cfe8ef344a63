"""The tiled MLP under DDP (full and LoRA), FSDP2 and DeepSpeed ZeRO-2/3 on two CPU processes (gloo): every
engine trains with the same losses tiled as whole (fp32), the report's recorder saw every MLP run in tiles, and
the gradient reductions are as many tiled as whole (once per step, not once per tile)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from distributed_helpers import DIST, distributed_marks, executable, launch

pytestmark = [*distributed_marks(), pytest.mark.slow]
REDUCTIONS = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter", "reduce", "ddp_bucket_all_reduce")


def _train(tmp_path, engine: str, env: dict | None = None) -> dict:
    launch([executable("torchrun"), "--standalone", "--nproc_per_node", "2", str(DIST / "long_train.py"),
            "--engine", engine, "--out", str(tmp_path)], env=env)
    return json.loads((tmp_path / "results.json").read_text())


def _check_pair(whole: dict, tiled: dict) -> None:
    assert whole["world_size"] == 2 == tiled["world_size"]
    assert whole["tiled_mlp"]["applied"] == "off" and tiled["tiled_mlp"]["engaged"] is True, tiled["tiled_mlp"]
    seen = tiled["tiled_mlp"]["settings"]["seen"]
    assert seen["tiles"] > 1 and seen["mlps_run"] == 4, seen
    assert "the recorder saw every one run in the planned tiles" in tiled["tiled_mlp"]["reason"]
    assert tiled["checkpointing"]["engaged"] is True
    assert tiled["losses"] == pytest.approx(whole["losses"], rel=1e-5), (whole["losses"], tiled["losses"])
    for name in REDUCTIONS:  # the gradients are reduced once per step, tiled or not
        assert tiled["collectives"].get(name, 0) == whole["collectives"].get(name, 0), (name, whole, tiled)
    assert sum(tiled["collectives"].get(n, 0) for n in REDUCTIONS) >= 4, tiled["collectives"]  # >= one a step


def test_ddp_full_and_lora(tmp_path):
    results = _train(tmp_path, "ddp")
    _check_pair(results["whole"], results["tiled"])
    assert results["tiled"]["collectives"]["ddp_bucket_all_reduce"] == 4  # one bucket, once a step, 4 steps
    _check_pair(results["lora_whole"], results["lora_tiled"])
    assert results["lora_tiled"]["lora"]["engaged"] is True


def test_fsdp2(tmp_path):
    results = _train(tmp_path, "fsdp")
    _check_pair(results["whole"], results["tiled"])
    assert results["tiled"]["fsdp"]["engaged"] is True, results["tiled"]["fsdp"]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed not installed")
@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_zero(stage, tmp_path, torch_extensions):
    results = _train(tmp_path, f"zero{stage}", env=torch_extensions)
    _check_pair(results["whole"], results["tiled"])
    assert results["tiled"]["deepspeed"]["applied"] == f"zero-{stage}"
    if stage == 3:  # every rank runs the same number of tiles whatever its rows' length (ZeRO-3 gathers per tile)
        assert "whatever its length" in results["tiled"]["tiled_mlp"]["reason"]
        assert results["tiled"]["collectives"]["all_gather_into_tensor"] > results["whole"]["collectives"][
            "all_gather_into_tensor"]
