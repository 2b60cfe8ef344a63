"""examples/slurm/train.sbatch itself, run by bash with stand-ins for srun and scontrol first on PATH
(tests/dist/slurm/): srun starts the command once per node on this machine with the SLURM_* variables a task
gets, and forwards the signals it receives; scontrol names 127.0.0.1 as every node and records a requeue.
The script runs in its CPU mode (gloo), two nodes x one process, the worker tests/dist/multinode_train.py.

- SIGUSR1 to the batch script (what ``#SBATCH --signal=B:USR1@120`` sends before the time limit): forwarded
  through srun and each node's torchrun to every worker, which save the same step and exit 138; the script
  requeues the job; the requeued job (the same command) resumes from that checkpoint and finishes the run;
- a node that never arrives: the other stops after the script's stated join timeout, and the job ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from distributed_helpers import DIST, ROOT, distributed_marks, free_port, launch_env, rank_results

import fsdp_train as F  # the run's length (tests/dist: importable once distributed_helpers is)

pytestmark = distributed_marks()
SBATCH = ROOT / "examples" / "slurm" / "train.sbatch"
STANDINS = DIST / "slurm"
WORKER = DIST / "multinode_train.py"

JOB = "4242"


def _job_env(out: Path, **extra: str) -> dict:
    env = launch_env()
    env.update(PATH=f"{STANDINS}{os.pathsep}{env.get('PATH', '')}", SLURM_NNODES="2", SLURM_JOB_ID=JOB,
               SLURM_JOB_NODELIST="node[0-1]", HF_SPEEDUP_DEVICE="cpu", NPROC_PER_NODE="1",
               MASTER_PORT=str(free_port()), SCONTROL_STANDIN_LOG=str(out / "scontrol.log"), JOIN_TIMEOUT="120")
    env.update(extra)
    return env


def _job(out: Path, tag: str, *args: str, **env: str) -> subprocess.Popen:
    cmd = ["bash", str(SBATCH), str(WORKER), "--out", str(out), "--tag", tag, "--output-dir", str(out / "run"),
           "--strategy", "full_shard", "--resume", "auto", *args]
    log = open(out / f"{tag}.log", "w")
    return subprocess.Popen(cmd, cwd=ROOT, env=_job_env(out, **env), stdout=log, stderr=subprocess.STDOUT)


def _ranks(out: Path, tag: str) -> list[dict]:
    return rank_results(out, f"{tag}.")


def _log(out: Path, tag: str) -> str:
    return (out / f"{tag}.log").read_text()


@pytest.fixture(scope="module")
def preempted_and_requeued(tmp_path_factory):
    out = tmp_path_factory.mktemp("slurm")
    job = _job(out, "first", "--marker-at", "3", "--slow", "1")
    deadline = time.monotonic() + 400
    while not (out / "first.ready").exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (out / "first.ready").exists(), _log(out, "first")[-6000:]
    job.send_signal(signal.SIGUSR1)  # --signal=B:USR1@120: to the batch script only
    first_status = job.wait(timeout=300)
    requeues = (out / "scontrol.log").read_text() if (out / "scontrol.log").exists() else ""
    (out / "first.checkpoints").write_text(" ".join(sorted(p.name for p in (out / "run").glob("checkpoint-*"))))
    again = _job(out, "requeued", SLURM_RESTART_COUNT="1")
    assert again.wait(timeout=540) == 0, _log(out, "requeued")[-6000:]
    return out, first_status, requeues, _ranks(out, "first"), _ranks(out, "requeued")


def test_sigusr1_to_the_batch_script_checkpoints_every_node_and_requeues(preempted_and_requeued):
    out, status, requeues, first, _ = preempted_and_requeued
    assert status != 0 and requeues == f"requeue {JOB}\n", _log(out, "first")[-4000:]
    assert "requeueing job 4242" in _log(out, "first")
    step = first[0]["stopped_step"]
    for node, res in enumerate(first):
        assert res["env"]["SLURM_NODEID"] == str(node)  # one torchrun per node, as srun starts them
        assert (res["exit_status"], res["stopped_step"]) == (138, step)  # 128 + SIGUSR1
        assert res["interrupt"]["settings"]["received"] == "SIGUSR1"
    assert (out / "first.checkpoints").read_text() == f"checkpoint-2 checkpoint-{step}"


def test_the_requeued_job_resumes_from_that_checkpoint_and_finishes(preempted_and_requeued, one_process_losses):
    out, _, _, first, requeued = preempted_and_requeued
    step = first[0]["stopped_step"]
    stopped = {int(k): v for k, v in first[0]["losses"].items()}
    for res in requeued:
        assert res["exit_status"] == 0 and res["global_step"] == F.STEPS
        assert res["resumed_from"] == str(out / "run" / f"checkpoint-{step}")
        got = {int(k): v for k, v in res["losses"].items()}
        assert {s: got[s] for s in stopped} == stopped  # the first job's steps, carried in the checkpoint
        if res["fsdp"]["settings"]["mixed_precision"] is None:  # fp32: the one-process losses up to reduction order
            assert got == pytest.approx(one_process_losses, rel=1e-6)
    assert "restart 1" in _log(out, "requeued")
    assert (out / "scontrol.log").read_text() == f"requeue {JOB}\n"  # a finished job is not requeued


def test_a_node_that_never_arrives_ends_the_job_after_the_join_timeout(tmp_path):
    start = time.monotonic()
    job = _job(tmp_path, "alone", SRUN_STANDIN_ABSENT="1", JOIN_TIMEOUT="5")
    status = job.wait(timeout=300)
    log = _log(tmp_path, "alone")
    assert status != 0, log[-4000:]
    assert "waiting up to 5 s for every node" in log
    assert "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError" in log
    assert time.monotonic() - start < 120  # not torch's default of 600 s
    assert not list(tmp_path.glob("alone.rank*.json"))  # no worker started
    assert not (tmp_path / "scontrol.log").exists()  # not requeued
