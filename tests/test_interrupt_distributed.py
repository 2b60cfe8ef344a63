"""Preemption in a real two-process run: ``torchrun --nproc_per_node 2`` on CPU (gloo), the ``fsdp`` preset.

- a SIGTERM that only rank 1 receives stops both ranks after the same step; each rank saves its shard of that
  step into ``checkpoint-3`` although ``save_strategy="no"``; both leave with status 143;
- ``train(resume_from_checkpoint=True)`` in a new launch (models initialised with another seed) continues
  with the uninterrupted run's losses, bit for bit, and the report counts the whole run;
- SIGTERM to ``torchrun`` itself (as a scheduler stops a job): the launcher forwards it, the ranks agree on
  the step, save it and exit 143 within the launcher's grace period. This run makes the feature see an
  "nccl" default group, so the agreement goes over the gloo side group a GPU run uses.

The workers are tests/dist/interrupt_train.py (they leave with ``os._exit`` after a barrier, see
tests/test_fsdp_distributed.py). A hub_token is planted in every run: it must reach no file.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from distributed_helpers import DIST, ROOT, distributed_marks, executable, launch, launch_env, rank_results

pytestmark = distributed_marks()
SCRIPT = DIST / "interrupt_train.py"
HUB_TOKEN = "hf_planted_distributed_token_91c2"
STEPS = 8


def _torchrun(out: Path, tag: str, *extra: str) -> list[str]:
    return [executable("torchrun"), "--standalone", "--nproc_per_node", "2", str(SCRIPT), "--out", str(out),
            "--tag", tag, "--preset", "fsdp", "--max-steps", str(STEPS), "--hub-token", HUB_TOKEN, *extra]


def _ranks(out: Path, tag: str) -> list[dict]:
    return rank_results(out, f"{tag}.")


def _launch(out: Path, tag: str, *extra: str, expect_ok: bool = True) -> list[dict]:
    proc = launch(_torchrun(out, tag, *extra), check=expect_ok, what=tag)
    if not expect_ok:
        assert proc.returncode != 0, "torchrun must report the workers' non-zero exit"
    return _ranks(out, tag)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("interrupt2")
    full = _launch(out, "full")
    part = _launch(out, "part", "--kill-at", "3", "--kill-rank", "1", expect_ok=False)
    resumed = _launch(out, "resumed", "--output-dir", str(out / "part"), "--resume")
    return out, full, part, resumed


def _losses(res: dict) -> dict[int, float]:
    return {int(k): v for k, v in res["losses"].items()}


def test_a_signal_on_one_rank_stops_both_after_the_same_step(runs):
    out, _, part, _ = runs
    for r, res in enumerate(part):
        assert (res["exit_status"], res["stopped_step"], res["global_step"]) == (143, 3, 3), r
        facts = res["interrupt"]["settings"]
        assert facts["received"] == "SIGTERM" and facts["stopped_at_step"] == 3
        assert facts["agreement"].startswith("all-reduce (MAX) of one integer per optimizer step over the default")
        assert res["interrupt"]["engaged"] is True
    # every rank saved its part of step 3, with save_strategy="no"
    ckpt = out / "part" / "checkpoint-3"
    assert sorted(p.name for p in (out / "part").glob("checkpoint-*")) == ["checkpoint-3"]
    assert {"pytorch_model_fsdp_0", "optimizer_0", "rng_state_0.pth", "rng_state_1.pth", "trainer_state.json",
            "hf_speedup_state.json"} <= {p.name for p in ckpt.iterdir()}
    assert sorted(p.name for p in (ckpt / "pytorch_model_fsdp_0").iterdir()) == [".metadata", "__0_0.distcp",
                                                                                 "__1_0.distcp"]
    assert sorted(p.name for p in (ckpt / "optimizer_0").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_resume_reproduces_the_uninterrupted_losses_bitwise(runs):
    out, full, part, resumed = runs
    reference = _losses(full[0])
    assert sorted(reference) == list(range(1, STEPS + 1)) and reference[STEPS] < reference[1]
    for r in (0, 1):
        assert _losses(full[r]) == reference
        assert _losses(part[r]) == {s: reference[s] for s in (1, 2, 3)}
        assert _losses(resumed[r]) == reference, r  # steps 4-8 trained after the resume: the same bits
        assert resumed[r]["exit_status"] == 0 and resumed[r]["global_step"] == STEPS
    report = json.loads((out / "part" / "speedup_report.json").read_text())
    full_report = json.loads((out / "full" / "speedup_report.json").read_text())
    m = report["measurement"]
    assert (m["steps"], m["train_runs"]) == (STEPS, 2)
    assert m["tokens"] == full_report["measurement"]["tokens"]
    assert m["resumed_from"] == str(out / "part" / "checkpoint-3")


def test_sigterm_to_torchrun_reaches_every_rank_which_stop_at_one_step(tmp_path):
    out = tmp_path
    cmd = _torchrun(out, "ext", "--max-steps", "60", "--marker-at", "2", "--slow", "0.3", "--as-if-nccl")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 400
    while not (out / "ext.ready").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (out / "ext.ready").exists(), proc.communicate()[0][-6000:] if proc.poll() is not None else "no marker"
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    ranks = _ranks(out, "ext")
    step = ranks[0]["stopped_step"]
    assert step is not None and 2 <= step < 60, output[-6000:]
    for res in ranks:
        assert (res["exit_status"], res["stopped_step"]) == (143, step)
        assert res["interrupt"]["settings"]["received"] == "SIGTERM"
        # as on a GPU run: the default group is not gloo, the agreement runs over a gloo side group
        assert res["interrupt"]["settings"]["agreement"].endswith("gloo side group (default backend nccl)")
    assert sorted(p.name for p in (out / "ext").glob("checkpoint-*")) == [f"checkpoint-{step}"]
    assert {"__0_0.distcp", "__1_0.distcp"} <= {p.name for p in (out / "ext" / f"checkpoint-{step}" /
                                                                 "pytorch_model_fsdp_0").iterdir()}


def test_no_planted_hub_token_in_any_file(runs):
    out = runs[0]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "training_args.bin" for p in files)  # the FSDP save wrote the arguments
    assert [str(p) for p in files if HUB_TOKEN.encode() in p.read_bytes()] == []
