"""A sharded checkpoint is complete only when every rank's part is on disk: ``torchrun --nproc_per_node 2`` on
CPU (gloo), the ``fsdp`` preset (each rank writes its own shards and RNG state).

Rank 1 is SIGKILLed inside its ``rng_state_1.pth`` of the save of step 4 (rank 0 has written, or is writing, its
own part): no ``checkpoint-4`` appears, since the rename waits for every rank. The relaunch with
``train(resume_from_checkpoint=True)`` sets the staging folder aside, resumes both ranks from checkpoint-2 and
computes steps 3 and 4 exactly as the killed run had.

The workers are tests/dist/kill_train.py (they leave with ``os._exit`` after a barrier, see
tests/test_fsdp_distributed.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from distributed_helpers import DIST, distributed_marks, executable, launch
from hf_speedup.features.crash_safe import files

pytestmark = distributed_marks()
SCRIPT = DIST / "kill_train.py"


def _launch(out: Path, tag: str, *extra: str) -> subprocess.CompletedProcess:
    return launch([executable("torchrun"), "--standalone", "--nproc_per_node", "2", str(SCRIPT), "--out", str(out),
                   "--tag", tag, "--preset", "fsdp", "--output-dir", str(out / "run"), *extra], check=False)


def _result(out: Path, tag: str, rank: int) -> dict | None:
    path = out / f"{tag}.rank{rank}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def test_a_rank_killed_inside_its_part_of_a_sharded_save_leaves_no_checkpoint_that_resume_picks(tmp_path):
    killed = _launch(tmp_path, "killed", "--kill-rank", "1", "--kill-where", r"checkpoint-4/rng_state_1")
    assert killed.returncode != 0
    assert "Signal 9 (SIGKILL) received" in killed.stderr + killed.stdout
    assert _result(tmp_path, "killed", 1) is None  # rank 1 died inside its write
    run = tmp_path / "run"
    assert not (run / "checkpoint-4").exists() and (run / "_checkpoint-4.staging").is_dir()

    resumed = _launch(tmp_path, "resumed", "--resume")
    assert resumed.returncode == 0, f"{resumed.stdout[-3000:]}\n{resumed.stderr[-5000:]}"
    ranks = [_result(tmp_path, "resumed", r) for r in (0, 1)]
    for r, res in enumerate(ranks):
        assert res["error"] is None, (r, res["error"])
        assert Path(res["crash_safe"]["settings"]["resumed_from"]).name == "checkpoint-2", r
        assert res["global_step"] == 8, r
    [moved] = ranks[0]["crash_safe"]["settings"]["set_aside"]
    assert Path(moved["moved_to"]).parent == run / files.INCOMPLETE_DIR
    assert Path(moved["moved_to"]).name.startswith("checkpoint-4.")
    assert sorted(p.name for p in run.glob("*checkpoint*")) == [files.INCOMPLETE_DIR, "checkpoint-6", "checkpoint-8"]
    before = _result(tmp_path, "killed", 0)  # rank 0 died of the broken group (gloo), after logging steps 1-4
    assert "gloo" in before["error"] or "Connection" in before["error"], before["error"]
    assert {k: before["losses"][k] for k in ("3", "4")} == {k: ranks[0]["losses"][k] for k in ("3", "4")}


def _ranks(out: Path, tag: str) -> list[dict]:
    ranks = [_result(out, tag, r) for r in (0, 1)]
    assert all(r is not None and r["error"] is None for r in ranks), [r and r["error"] for r in ranks]
    return ranks


@pytest.mark.parametrize("preset", ["auto", "fsdp"])
def test_two_processes_save_in_the_background_and_a_sigterm_resume_ends_as_the_uninterrupted_run(tmp_path, preset):
    """DDP (``auto``) and FSDP2 (``fsdp``: its sharded DCP folders too) on 2 CPU processes (background saves forced
    on: ``auto`` saves synchronously where the processes' threads fill the cores): every save of the
    uninterrupted run went through the writer threads; SIGTERM at step 5 (checkpoint-4 possibly still being
    written) drains, saves step 5 and exits; the requeued job ends with the uninterrupted run's weights and losses."""
    def run(tag: str, *extra: str) -> subprocess.CompletedProcess:
        return launch([executable("torchrun"), "--standalone", "--nproc_per_node", "2", str(SCRIPT), "--out",
                       str(tmp_path), "--tag", tag, "--preset", preset, "--async-save", *extra], check=False)

    whole = run("whole")
    assert whole.returncode == 0, whole.stderr[-5000:]
    for res in _ranks(tmp_path, "whole"):
        settings = res["crash_safe"]["settings"]
        assert settings["asynchronous"] is True
        assert settings["saves_background"] == 4 and settings["committed"] == 4, settings
        assert not settings.get("failed_saves") and not settings.get("synchronous_saves")
    cut_dir = str(tmp_path / "cut")
    run("stopped", "--output-dir", cut_dir, "--sigterm-at", "5")
    assert [r["exit_status"] for r in _ranks(tmp_path, "stopped")] == [143, 143]
    assert sorted(p.name for p in Path(cut_dir).glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-5"]
    resumed = run("resumed", "--output-dir", cut_dir, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    full, again = _ranks(tmp_path, "whole"), _ranks(tmp_path, "resumed")
    for r in (0, 1):
        assert Path(again[r]["crash_safe"]["settings"]["resumed_from"]).name == "checkpoint-5"
        assert again[r]["digest"] == full[r]["digest"]
        assert {k: v for k, v in again[r]["losses"].items() if int(k) > 5} == \
            {k: v for k, v in full[r]["losses"].items() if int(k) > 5}
