"""Two nodes x two processes on one machine: two torchrun launchers on localhost (c10d rendezvous, gloo on CPU
processes) stand in for two machines, with ``fsdp.strategy: hybrid_shard`` (tests/dist/multinode_train.py).

- the uninterrupted run: a 2x2 mesh (dp_replicate, dp_shard) with placements (Replicate(), Shard(0)), each shard
  group inside one launcher ("node"), half the model per rank, losses of one process on the same global batch,
  the report's node/mesh description, a final save that ``from_pretrained`` loads;
- its 4-process sharded checkpoint resumed on 2 processes and on 1 (the state loaded bit for bit);
- SIGTERM to one node's launcher: every rank on both nodes saves the same step and exits 143; the relaunch
  (``torchrun --max-restarts 1``) loads that checkpoint bit for bit, a worker is SIGKILLed mid-run, torch elastic
  restarts the group, ``train(resume_from_checkpoint=True)`` resumes from the newest checkpoint, and the run ends
  with the uninterrupted run's losses, bit for bit;
- a rank of node 1 SIGKILLed inside its part of a sharded save: no checkpoint of that step appears, both launchers
  stop; the relaunch sets the unfinished save aside and ends with the uninterrupted run's losses, bit for bit.

Each rank's facts come back as JSON, the full training state as ``.pt`` files written by rank 0.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from distributed_helpers import (DIST, ROOT, distributed_marks, executable, free_port, launch, launch_env,
                                 rank_results)
from hf_speedup import get_preset
from hf_speedup.accelerate_config import SHIPPED, write_accelerate_config
from hf_speedup.features.crash_safe import files

import fsdp_train as F  # tests/dist: importable once distributed_helpers is
import multinode_train as M

pytestmark = distributed_marks()
SCRIPT = DIST / "multinode_train.py"

HALF = 213_568 * 4 // 2  # the tiny Llama in fp32, split over a shard group of 2
LOSS_REL = 1e-6  # fp32: another world size only reorders the sums
# restarted workers must not find the first attempt's keys in the rendezvous store torchrun shares with them
ELASTIC_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def start_nodes(out: Path, tag: str, *args: str, nodes: int = 2, nproc: int = 2, torchrun_args: tuple = (),
                env: dict | None = None) -> list[subprocess.Popen]:
    """One torchrun per node, all on 127.0.0.1: c10d rendezvous on a free port; TEST_NODE tells the ranks apart."""
    port = free_port()
    procs = []
    for node in range(nodes):
        cmd = [executable("torchrun"), "--nnodes", str(nodes), "--nproc_per_node", str(nproc), "--node_rank", str(node),
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", tag,
               *torchrun_args, str(SCRIPT), "--out", str(out), "--tag", tag, *args]
        log = open(out / f"{tag}.node{node}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**launch_env(), **(env or {}), "TEST_NODE": str(node)},
                                      stdout=log, stderr=subprocess.STDOUT))
    return procs


def finish(procs: list[subprocess.Popen], out: Path, tag: str, ok: bool = True, timeout: float = 600) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"{tag}: launchers still running after {timeout} s\n{_logs(out, tag)}") from None
    if ok and any(codes):
        raise AssertionError(f"{tag}: launchers exited {codes}\n{_logs(out, tag)}")
    return codes


def _logs(out: Path, tag: str) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-5000:]}" for p in sorted(out.glob(f"{tag}.node*.log")))


def ranks(out: Path, tag: str, world: int = 4) -> list[dict]:
    return rank_results(out, f"{tag}.", range(world))


def same_state(a: Path, b: Path) -> list[str]:
    """Where two dumped training states differ (empty: bit for bit the same)."""
    import torch

    sa, sb = torch.load(a, weights_only=False), torch.load(b, weights_only=False)
    diffs = []

    def walk(x, y, path):
        if isinstance(x, dict):
            if set(x) != set(y):
                diffs.append(f"{path}: keys {sorted(set(x) ^ set(y))[:5]}")
            for k in set(x) & set(y):
                walk(x[k], y[k], f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{path}[{i}]")
        elif isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x, y)):
                diffs.append(path)
        elif x != y:
            diffs.append(f"{path}: {x!r} != {y!r}")

    walk(sa, sb, "")
    assert sa["model"] and sa["optimizer"]["state"], "an empty state would compare equal"
    return diffs


def _losses(res: dict) -> dict[int, float]:
    return {int(k): v for k, v in res["losses"].items()}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("nodes")


@pytest.fixture(scope="module")
def two_nodes(out):
    finish(start_nodes(out, "nodes", "--dump-state", "--final-save"), out, "nodes")
    return ranks(out, "nodes")


@pytest.fixture(scope="module")
def preempted(out, two_nodes):
    """SIGTERM to node 1's launcher while training; then the relaunch, in which a worker is SIGKILLed."""
    procs = start_nodes(out, "pre", "--dump-state", "--marker-at", "3", "--slow", "1")
    deadline = time.monotonic() + 400
    while not (out / "pre.ready").exists() and all(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert (out / "pre.ready").exists(), _logs(out, "pre")
    procs[1].send_signal(signal.SIGTERM)  # node 1 only: its launcher forwards it to its own two workers
    codes = finish(procs, out, "pre", ok=False)
    stopped = ranks(out, "pre")
    relaunch = start_nodes(out, "re", "--output-dir", str(out / "pre"), "--resume", "auto", "--dump-state",
                           "--crash-at", "7", "--crash-rank", "1", "--final-save",
                           torchrun_args=("--max-restarts", "1"), env=ELASTIC_ENV)
    finish(relaunch, out, "re")
    return codes, stopped, ranks(out, "re")


# ------------------------------------------------------------------------------------------ item: 2 nodes x 2
def test_two_nodes_form_a_2x2_mesh_sharded_inside_each_node(two_nodes):
    by_rank = {r["rank"]: r for r in two_nodes}
    for res in two_nodes:
        assert res["mesh"] == [[0, 1], [2, 3]] and res["mesh_dim_names"] == ["dp_replicate", "dp_shard"]
        assert res["embed_placements"] == "(Replicate(), Shard(dim=0))"
        assert res["embed_local_shape"] == [256, 64]  # half the vocabulary rows: sharded over 2, not 4
        s = res["summary"]
        assert s["rank_bytes"] == {str(r): HALF for r in range(4)} and s["this_rank_bytes"] == HALF
        assert s["shard_groups"] == [[0, 1], [2, 3]] and s["shard_groups_within_a_node"] is True
        assert res["env"]["LOCAL_WORLD_SIZE"] == "2" and res["env"]["WORLD_SIZE"] == "4"
    # each shard group was started by one launcher, the two groups by different ones: shard inside, replicate across
    for group in ([0, 1], [2, 3]):
        assert len({by_rank[r]["env"]["TEST_NODE"] for r in group}) == 1, group
    assert by_rank[0]["env"]["TEST_NODE"] != by_rank[2]["env"]["TEST_NODE"]


def test_two_nodes_losses_are_one_process_losses_on_the_same_global_batch(two_nodes, one_process_losses):
    for res in two_nodes:
        got = _losses(res)
        assert sorted(got) == list(range(1, F.STEPS + 1))
        assert got == _losses(two_nodes[0])  # every rank logs the same mean
        fp32 = res["fsdp"]["settings"]["mixed_precision"] is None
        assert got == pytest.approx(one_process_losses, rel=LOSS_REL if fp32 else 3e-2)  # bf16 (AMX CPUs): rounding


def test_the_report_describes_the_nodes_and_the_mesh(out, two_nodes):
    entry = json.loads((out / "nodes" / "speedup_report.json").read_text())["plan"]["fsdp"]
    assert entry["engaged"] is True and entry["settings"]["strategy"] == "hybrid_shard"
    assert "FSDP2 hybrid_shard over 4 rank(s) (2 node(s) x 2 process(es): mesh dp_replicate=2 x dp_shard=2, " \
           "sharded within a node, replicated across nodes)" in entry["reason"]
    assert "verified: FSDP2 hybrid_shard: 7 units, 4 ranks, 427.1 KB/rank of 854.3 KB; mesh dp_replicate=2 x " \
           "dp_shard=2: 2 node(s) x 2 process(es), shard group(s) [0, 1] [2, 3] each within one node, replicated " \
           "across nodes" in entry["reason"]
    verified = entry["settings"]["verified"]
    assert (verified["nodes"], verified["processes_per_node"], verified["mesh_shape"]) == (2, 2, [2, 2])


def test_the_final_save_is_a_full_model_from_pretrained_loads(out, two_nodes):
    rank0 = two_nodes[0]
    assert rank0["final_saved_equal"] is True  # bit for bit the gathered live state
    assert {"model.safetensors", "config.json"} <= set(rank0["final_saved_files"])


# ------------------------------------------------------------------------------------------ across world sizes
def test_a_four_process_checkpoint_resumes_on_two_processes(out, two_nodes):
    launch([executable("torchrun"), "--standalone", "--nproc_per_node", "2", str(SCRIPT), "--out", str(out),
            "--tag", "two", "--resume", str(out / "nodes" / "checkpoint-4"), "--dump-state"])
    assert same_state(out / "nodes.saved-4.pt", out / "two.loaded-4.pt") == []  # resharded 4 -> 2, bit for bit
    uninterrupted = _losses(two_nodes[0])
    for res in ranks(out, "two", world=2):
        assert res["mesh"] == [[0, 1]] and res["summary"]["this_rank_bytes"] == HALF
        got = _losses(res)
        assert {s: got[s] for s in (1, 2, 3, 4)} == {s: uninterrupted[s] for s in (1, 2, 3, 4)}  # from the checkpoint
        if res["fsdp"]["settings"]["mixed_precision"] is None:
            assert got == pytest.approx(uninterrupted, rel=LOSS_REL)  # steps 5-8: 2 ranks sum in another order


def test_a_four_process_checkpoint_resumes_in_one_process(out, two_nodes, monkeypatch):
    """FSDP is off in one process: the stock Trainer refuses the sharded checkpoint ("... is only supported when
    using PyTorch FSDP"); SpeedupTrainer reads it whole, optimizer included, and says so."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert M.main(["--out", str(out), "--tag", "one", "--resume", str(out / "nodes" / "checkpoint-4"),
                   "--dump-state"]) == 0
    assert same_state(out / "nodes.saved-4.pt", out / "one.loaded-4.pt") == []
    res = ranks(out, "one", world=1)[0]
    assert res["fsdp"]["applied"] == "off"
    assert "resumed from an FSDP checkpoint (4 shards) in a run that does not shard: pytorch_model_fsdp_0 read " \
           "whole, optimizer state likewise" in res["fsdp"]["reason"]
    if res["fsdp"]["settings"].get("mixed_precision") is None and two_nodes[0]["fsdp"]["settings"][
            "mixed_precision"] is None:
        assert _losses(res) == pytest.approx(_losses(two_nodes[0]), rel=LOSS_REL)


# ------------------------------------------------------------------------------------------ faults at scale
def test_sigterm_to_one_node_stops_every_rank_of_both_nodes_at_one_step(out, preempted):
    codes, stopped, _ = preempted
    assert all(codes), codes  # both launchers report the stop (non-zero), neither hangs
    step = stopped[0]["stopped_step"]
    assert 3 <= step < 6, f"stopped at {step}: the relaunch below needs checkpoint-6 to come after it"
    for res in stopped:
        assert (res["exit_status"], res["stopped_step"], res["global_step"]) == (143, step, step), res["rank"]
        assert res["interrupt"]["settings"]["received"] == "SIGTERM"
    ckpt = out / "pre" / f"checkpoint-{step}"
    assert sorted(p.name for p in (ckpt / "pytorch_model_fsdp_0").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]
    assert {f"rng_state_{r}.pth" for r in range(4)} <= {p.name for p in ckpt.iterdir()}


def test_the_relaunch_loads_that_checkpoint_bit_for_bit(out, preempted):
    step = preempted[1][0]["stopped_step"]
    assert same_state(out / f"pre.saved-{step}.pt", out / f"re.loaded-{step}.pt") == []


def test_a_killed_worker_is_restarted_by_torch_elastic_and_the_run_ends_as_an_uninterrupted_one(
        out, two_nodes, preempted):
    _, _, relaunched = preempted
    assert (out / "re.crashed").read_text() == "7"  # rank 1 SIGKILLed itself after step 7, between saves
    assert same_state(out / "re.saved-6.pt", out / "re.loaded-6.pt") == []  # the newest complete checkpoint
    uninterrupted = _losses(two_nodes[0])
    for res in relaunched:
        assert res["exit_status"] == 0 and res["global_step"] == F.STEPS
        assert res["resumed_from"] == str(out / "pre" / "checkpoint-6")
        assert _losses(res) == uninterrupted, res["rank"]  # bit for bit
    assert relaunched[0]["final_saved_equal"] is True
    # the final model is the uninterrupted run's, bit for bit
    assert same_state(out / "nodes.saved-8.pt", out / "re.saved-8.pt") == []


def test_a_rank_killed_inside_its_part_of_a_save_on_another_node_leaves_no_checkpoint_the_relaunch_picks(
        out, two_nodes):
    """Rank 3 (the second node's second process) is SIGKILLed inside its rng_state_3.pth of the save of step 4, after every
    rank wrote its model and optimizer shards and while rank 0 waits to rename the folder: checkpoint-4 never
    appears and both launchers stop. The relaunch, as a requeued job (resume_from_checkpoint=True), sets the staging
    folder aside, resumes every rank from checkpoint-2 and ends as the uninterrupted run did."""
    run = out / "killed"
    killed = start_nodes(out, "killed", "--kill-where", r"checkpoint-4/rng_state_3\.pth$", "--kill-rank", "3")
    codes = finish(killed, out, "killed", ok=False, timeout=300)
    assert all(codes), codes  # both launchers report the failure, neither waits for the dead rank
    assert "Signal 9 (SIGKILL) received" in _logs(out, "killed")
    assert not list(out.glob("killed.rank*.json"))  # no rank got past the save of step 4
    staged = run / "_checkpoint-4.staging" / "checkpoint-4"
    assert sorted(p.name for p in run.glob("*checkpoint*")) == ["_checkpoint-4.staging", "checkpoint-2"]
    assert files.problem(str(staged)) == "rng_state_3.pth is truncated (a torch.save zip without its end record)"
    assert sorted(p.name for p in (staged / "pytorch_model_fsdp_0").iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]  # shards on both nodes' disks

    finish(start_nodes(out, "requeued", "--output-dir", str(run), "--resume", "auto"), out, "requeued", timeout=300)
    uninterrupted = _losses(two_nodes[0])
    for res in ranks(out, "requeued"):
        assert res["resumed_from"] == str(run / "checkpoint-2"), res["rank"]
        assert _losses(res) == uninterrupted, res["rank"]  # steps 3-8 trained again, bit for bit
    entry = json.loads((run / "speedup_report.json").read_text())["plan"]["crash_safe"]["settings"]
    [moved] = entry["set_aside"]
    assert moved["checkpoint"] == str(staged) and "its save did not finish" in moved["reason"]
    assert Path(moved["moved_to"]).parent == run / files.INCOMPLETE_DIR
    assert files.problem(moved["moved_to"]).startswith("rng_state_3.pth is truncated")  # kept as it was, to look at
    assert sorted(p.name for p in run.glob("*checkpoint*")) == [
        files.INCOMPLETE_DIR, "checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]


# ------------------------------------------------------------------------------------------ accelerate launch
def _multinode_config(path: Path) -> Path:
    """The shipped multi-node file (fsdp preset, HSDP: parallelism_config) for 2 machines x 2 processes."""
    preset, overrides, _, machines = SHIPPED["fsdp2_hybrid_multinode"]
    config = get_preset(preset).replace(**overrides)
    config.name = preset
    return write_accelerate_config(config, 4, machines, path)


def _machine_cmd(config: Path, rank: int, port: int, *args: str) -> list[str]:
    """The documented command (plus --mixed_precision no on CPU), one machine of two, both on 127.0.0.1."""
    return [executable("accelerate"), "launch", "--config_file", str(config), "--machine_rank", str(rank),
            "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--mixed_precision", "no", *args]


def test_accelerate_launch_of_the_multinode_config_on_two_cpu_machines(out, two_nodes):
    """accelerate refuses a parallelism_config on CPU processes (every rank stopped in Accelerator() with
    'ParallelismConfig is only compatible DistributedType.FSDP (version 2) ... MULTI_CPU'); with the fsdp preset
    hf_speedup applies the file's HSDP layout itself. The run resumes the torchrun run's checkpoint-6: same mesh,
    same losses, bit for bit."""
    config = _multinode_config(out / "two_machines.yaml")
    port = free_port()
    procs = []
    for rank in (0, 1):
        cmd = _machine_cmd(config, rank, port, "--rdzv_conf", "timeout=120", str(SCRIPT), "--out", str(out), "--tag",
                           "acc", "--strategy", "full_shard", "--resume", str(out / "nodes" / "checkpoint-6"))
        log = open(out / f"acc.node{rank}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env={**launch_env(), "TEST_NODE": str(rank)}, stdout=log,
                                      stderr=subprocess.STDOUT))
    finish(procs, out, "acc")
    for res in ranks(out, "acc"):
        assert res["mesh"] == [[0, 1], [2, 3]] and res["embed_placements"] == "(Replicate(), Shard(dim=0))"
        entry = res["fsdp"]
        assert entry["engaged"] is True and "fsdp.strategy full_shard -> hybrid_shard: the accelerate launch " \
            "config asks for HSDP (dp_replicate_size=2, dp_shard_size=2)" in entry["fallbacks"]
        assert "the accelerate launch config's parallelism_config is applied by hf_speedup's FSDP2 (mesh " \
               "dp_replicate=2 x dp_shard=2); it was kept from accelerate's Accelerator" in entry["reason"]
        mixed = (entry["settings"]["mixed_precision"], two_nodes[0]["fsdp"]["settings"]["mixed_precision"])
        if mixed[0] == mixed[1]:  # steps 7-8 trained here, 1-6 from the checkpoint
            assert _losses(res) == _losses(two_nodes[0])
        else:  # an AMX CPU: torchrun's plan is bf16 (auto), the launch file's mixed_precision is its own
            assert _losses(res) == pytest.approx(_losses(two_nodes[0]), rel=3e-2)


def test_a_machine_that_never_joins_stops_the_accelerate_launch_after_the_stated_timeout(tmp_path):
    start = time.monotonic()
    proc = launch(_machine_cmd(_multinode_config(tmp_path / "c.yaml"), 0, free_port(), "--rdzv_conf", "timeout=5",
                               str(SCRIPT), "--out", str(tmp_path), "--tag", "alone"), timeout=300, check=False)
    assert proc.returncode != 0
    assert "DistStoreError: Timed out after" in proc.stderr and "1/2 clients joined" in proc.stderr, proc.stderr[-3000:]
    assert time.monotonic() - start < 120
    assert not list(tmp_path.glob("alone.rank*.json"))
