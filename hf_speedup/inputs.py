"""What the user hands SpeedupTrainer, checked at construction: one clear error (field, value, allowed
values, fix) instead of a traceback at batch 1, or a run that trains on nothing and looks like success.

- the launch: ``WORLD_SIZE`` > 1 without the rest of a launcher's variables (torchrun/accelerate set all); a
  warning where torch elastic restarts would fail (``launch_warnings``);
- the output directory: it must be a directory that can be created and written;

The training set is checked by the data feature (``features/data``: its ``problems`` hook), which knows whether
the plan flattens rows.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

from .config import SpeedupConfigError

LAUNCHER_VARS = ("RANK", "MASTER_ADDR", "MASTER_PORT")  # what torch.distributed's env:// start needs with WORLD_SIZE
logger = logging.getLogger("hf_speedup")


# --------------------------------------------------------------------------------------------- launch
def launch_problems(environ=None) -> list[str]:
    """``WORLD_SIZE`` > 1 must come with the launcher's other variables, or every process waits for peers."""
    env = os.environ if environ is None else environ
    raw = env.get("WORLD_SIZE")
    if raw is None:
        return []
    try:
        world = int(raw)
    except ValueError:
        return [f"WORLD_SIZE = {raw!r} is not allowed; allowed: a whole number of processes (set by torchrun or "
                "accelerate launch); fix: unset WORLD_SIZE, or start the run with torchrun --nproc_per_node N"]
    if world < 1:
        return [f"WORLD_SIZE = {raw!r} is not allowed; allowed: an integer >= 1; fix: unset WORLD_SIZE"]
    missing = [v for v in LAUNCHER_VARS if not env.get(v)]
    if world > 1 and missing:
        return [f"WORLD_SIZE = {raw!r} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: "
                "this process was not started by a launcher, so it cannot find its peers; allowed: WORLD_SIZE "
                f"together with {', '.join(LAUNCHER_VARS)} (torchrun and accelerate launch set all of them); fix: "
                f"launch with torchrun --nproc_per_node {world} train.py (or accelerate launch), or unset WORLD_SIZE "
                "for a single-process run"]
    return []


def launch_warnings(environ=None) -> list[str]:
    """What will go wrong later in this launch, said at once. torch elastic restarts (``torchrun --max-restarts``)
    with the rendezvous store shared with the workers (torch's default): the torch this was measured with (2.13)
    keeps that store across a restart, so the restarted workers read the first attempt's keys and fail to
    connect in ``init_process_group`` (gloo: ``connectFullMesh failed ... Connection refused``), one node or
    several."""
    env = os.environ if environ is None else environ
    try:
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return []
    if restarts > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("RANK", "0") == "0":
        return [f"torchrun --max-restarts {restarts}: a restarted worker group re-uses the rendezvous store torchrun "
                "shares with the workers and finds the first attempt's keys there, so it fails to connect "
                "(init_process_group) instead of resuming; fix: export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before "
                "torchrun (a store per attempt; examples/slurm/train.sbatch does)"]
    return []


def warn(warnings: list[str]) -> None:
    for text in warnings:
        logger.warning("hf_speedup: %s", text)


# --------------------------------------------------------------------------------------------- output dir
def output_dir_problems(args) -> list[str]:
    """``output_dir`` must be (or become) a directory this process can write: probed with a temporary file in
    it or in its nearest existing parent, so read-only file systems and paths through a file are caught."""
    out = getattr(args, "output_dir", None)
    if not out:
        return []
    path = Path(out).expanduser()
    probe_dir = path
    while not probe_dir.exists() and probe_dir != probe_dir.parent:
        probe_dir = probe_dir.parent
    fix = "fix: set TrainingArguments(output_dir=...) to a writable directory"
    if not probe_dir.is_dir():
        what = "is" if probe_dir == path else f"would be inside {str(probe_dir)!r}, which is"
        return [f"TrainingArguments.output_dir = {out!r} {what} a file, not a directory; allowed: a directory "
                f"path; {fix}"]
    try:
        with tempfile.TemporaryFile(dir=probe_dir):
            pass
    except OSError as exc:
        where = "" if probe_dir == path else f" (it does not exist yet and cannot be created in {str(probe_dir)!r})"
        return [f"TrainingArguments.output_dir = {out!r} cannot be written{where}: {exc.strerror or exc}; "
                f"allowed: a writable directory; {fix}"]
    return []


def check(problems: list[str]) -> None:
    """Raise every problem found as one :class:`SpeedupConfigError`."""
    if problems:
        raise SpeedupConfigError(problems)

