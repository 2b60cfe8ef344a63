"""Two CPU processes under DeepSpeed ZeRO-2 and ZeRO-3 (gloo): the stock Trainer and SpeedupTrainer with baseline,
auto, fast, memory and lora on the same tiny model, data and shipped DeepSpeed config. Each preset trains with the
stock Trainer's losses (lora: its own, falling), the report names DeepSpeed with the engine's live stage and, under
ZeRO-3, every parameter partitioned; compile stays off under ZeRO-3 with no graph break or recompile. Each preset
also saves every 2 steps (crash-safe: staged, then renamed into place; DeepSpeed's per-rank ``global_step*``
layout inside) and a second trainer resumes from checkpoint-2 with the uninterrupted run's losses, bit for bit.
A rank killed inside its part of a save, and a signal to one rank, leave checkpoints resume can trust."""

from __future__ import annotations

import json

import pytest

from distributed_helpers import DIST, ROOT, distributed_marks, executable, launch

pytest.importorskip("deepspeed")
pytestmark = distributed_marks()
PRESETS = ("baseline", "auto", "fast", "memory", "lora")
SAME_LOSSES = ("baseline", "auto", "fast", "memory")


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
        # its engine writes its own checkpoint: saved synchronously, and the plan says so (baseline asks for it)
        assert crash_safe["settings"]["asynchronous"] is False, (preset, crash_safe)
        why = "asynchronous: false" if preset == "baseline" else "DeepSpeed's engine"
        assert why in crash_safe["reason"], (preset, crash_safe["reason"])
        assert "saves_background" not in crash_safe["settings"]
    lora = list(results["lora"]["losses"].values())
    assert len(lora) == 4 and lora[-1] < lora[0]
    if stage == 2:  # ZeRO-2 leaves the modules alone: fast's regional compile stays planned
        assert results["fast"]["plan"]["compile"]["applied"].startswith("blocks:"), results["fast"]["plan"]["compile"]


def _kill_train(tmp_path, stage: int, env: dict):
    """(launch kill_train.py under the shipped ZeRO config with these options, read a rank's result file)."""
    def run(tag: str, *extra: str, check: bool = True):
        return launch([executable("torchrun"), "--standalone", "--nproc_per_node", "2", str(DIST / "kill_train.py"),
                       "--out", str(tmp_path), "--tag", tag, "--preset", "auto", "--deepspeed",
                       str(ROOT / "configs" / "deepspeed" / f"zero{stage}.json"), *extra], env=env, check=check)

    def result(tag: str, rank: int) -> dict | None:
        path = tmp_path / f"{tag}.rank{rank}.json"
        return json.loads(path.read_text()) if path.is_file() else None

    return run, result


def test_a_rank_killed_inside_its_deepspeed_save_leaves_no_checkpoint_that_resume_picks(tmp_path, torch_extensions):
    """ZeRO-3 writes one file per rank (``global_step4/zero_pp_rank_R_*``): rank 1 SIGKILLed inside its own leaves no
    checkpoint-4 (the save was staged), and the requeued job resumes from checkpoint-2 to the uninterrupted run's
    losses and step, bit for bit."""
    from transformers.trainer_utils import get_last_checkpoint

    run, result = _kill_train(tmp_path, 3, torch_extensions)
    run("whole")
    whole = result("whole", 0)
    run_dir = tmp_path / "run"
    killed = run("killed", "--output-dir", str(run_dir), "--kill-rank", "1", "--kill-where",
                 r"checkpoint-4/global_step4/zero_pp_rank_1", check=False)
    assert killed.returncode != 0 and result("killed", 1) is None  # rank 1 died inside its write
    assert not (run_dir / "checkpoint-4").exists()
    assert get_last_checkpoint(str(run_dir)).endswith("checkpoint-2")
    run("resumed", "--output-dir", str(run_dir), "--resume")
    for rank in (0, 1):
        res = result("resumed", rank)
        assert res["error"] is None, res["error"]
        assert res["crash_safe"]["settings"]["resumed_from"].endswith("checkpoint-2")
        assert res["global_step"] == whole["global_step"] == 8
        assert res["losses"] == whole["losses"], rank
    assert (run_dir / "checkpoint-8" / "global_step8").is_dir()


def test_a_signal_on_one_rank_under_zero2_checkpoints_the_step_and_resumes(tmp_path, torch_extensions):
    """SIGTERM to rank 1 at step 3 (a preemption notice): both ranks stop after step 3 with a checkpoint of it (the
    interrupt feature; DeepSpeed's per-rank files inside), exit 143, and the requeued job resumes from checkpoint-3
    to the uninterrupted run's losses, bit for bit."""
    run, result = _kill_train(tmp_path, 2, torch_extensions)
    run("whole")
    run_dir = tmp_path / "run"
    run("stopped", "--output-dir", str(run_dir), "--sigterm-at", "3", "--kill-rank", "1")
    for rank in (0, 1):
        stopped = result("stopped", rank)
        assert stopped["error"] is None and stopped["exit_status"] == 143 and stopped["global_step"] == 3, stopped
    assert (run_dir / "checkpoint-3" / "global_step3").is_dir()
    run("resumed", "--output-dir", str(run_dir), "--resume")
    resumed, whole = result("resumed", 0), result("whole", 0)
    assert resumed["crash_safe"]["settings"]["resumed_from"].endswith("checkpoint-3")
    assert resumed["losses"] == whole["losses"] and resumed["global_step"] == 8
