"""Checkpoint folders on disk: complete or ignored, whenever the process is killed.

The Trainer writes ``checkpoint-N`` in place, file after file, and resume takes the highest ``checkpoint-N``
(``get_last_checkpoint``) without looking inside: a kill (SIGKILL after a scheduler's grace period, the OOM
killer) or a full disk during a save leaves a folder resume then fails on, until someone deletes it.

Here a save goes to ``_checkpoint-N.staging/checkpoint-N`` (a name neither ``get_last_checkpoint``, checkpoint
rotation nor the Hub upload picks up); once every file of every rank is written, the files and folders are
fsync'ed and the folder is renamed to ``checkpoint-N``: one rename, atomic on a POSIX file system. Rotation
renames a checkpoint to ``_checkpoint-N.deleting`` before it deletes it. On resume, a folder left by an
unfinished save, and a ``checkpoint-N`` that is broken (a stock Trainer's half-written one), is moved into
``_incomplete_checkpoints/`` (renamed, never deleted) with the reason.

Pure file-system functions; the Trainer hooks are in ``features/crash_safe/__init__.py``.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import struct
import time
import zipfile
from dataclasses import dataclass

logger = logging.getLogger("hf_speedup")

PREFIX = "checkpoint"  # transformers' PREFIX_CHECKPOINT_DIR
CHECKPOINT_RE = re.compile(rf"^{PREFIX}-(\d+)$")  # transformers' _re_checkpoint
STAGING_SUFFIX = ".staging"
DELETING_SUFFIX = ".deleting"
LEFTOVER_RE = re.compile(rf"^_{PREFIX}-(\d+)(\{STAGING_SUFFIX}|\{DELETING_SUFFIX})$")
INCOMPLETE_DIR = "_incomplete_checkpoints"
TRAINER_STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME
JIT_SENTINEL = "checkpoint-is-incomplete.txt"  # transformers' JIT checkpoint marks its unfinished save with it
DCP_METADATA = ".metadata"  # torch.distributed.checkpoint writes it last, after every rank's shard
# files whose content the Trainer reads back on resume: an empty one is a broken checkpoint
LOADED_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth")
ZIP_MAGIC = b"PK\x03\x04"  # torch.save's (zip) format


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}-{step}"


def staging_root(run_dir: str, step: int) -> str:
    """Where ``checkpoint-<step>`` is written before it is renamed into ``run_dir``."""
    return os.path.join(run_dir, f"_{checkpoint_name(step)}{STAGING_SUFFIX}")


def step_of(path: str) -> int | None:
    match = CHECKPOINT_RE.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def checkpoints_by_step(run_dir: str) -> list[str]:
    """The ``checkpoint-N`` folders of ``run_dir``, newest step first (the order resume looks at them in)."""
    try:
        names = os.listdir(run_dir)
    except FileNotFoundError:
        return []
    found = [(step_of(n), os.path.join(run_dir, n)) for n in names]
    return [p for s, p in sorted((s, p) for s, p in found if s is not None and os.path.isdir(p))][::-1]


# ------------------------------------------------------------------------------------------ completeness
def problem(checkpoint: str) -> str | None:
    """Why ``checkpoint`` cannot be resumed from (None: complete).

    A folder this module renamed into place is complete by construction; this also catches what a stock
    Trainer left: transformers' JIT sentinel, a missing or unparsable ``trainer_state.json`` (written last),
    and any file resume reads that is empty or truncated (JSON that does not parse, a safetensors file shorter
    than its header says, a torch zip without its end record, a DCP folder without ``.metadata``).
    """
    if not os.path.isdir(checkpoint):
        return "not a folder"
    if os.path.exists(os.path.join(checkpoint, JIT_SENTINEL)):
        return f"{JIT_SENTINEL} is there: transformers' JIT checkpoint did not finish it"
    if not os.path.isfile(os.path.join(checkpoint, TRAINER_STATE)):
        return f"{TRAINER_STATE} is missing (the Trainer writes it last: the save did not finish)"
    for folder, dirs, files in os.walk(checkpoint):
        dirs.sort()
        if any(f.endswith(".distcp") for f in files) and DCP_METADATA not in files:
            return (f"{os.path.relpath(folder, checkpoint)}/ holds shards but no {DCP_METADATA} "
                    "(torch.distributed.checkpoint writes it once every rank's shard is written)")
        for name in sorted(files):
            path = os.path.join(folder, name)
            why = _file_problem(path, name)
            if why:
                return f"{os.path.relpath(path, checkpoint)} {why}"
    return None


def _file_problem(path: str, name: str) -> str | None:
    if not (name.endswith(LOADED_SUFFIXES) or name == DCP_METADATA):
        return None
    try:
        size = os.path.getsize(path)
        if size == 0:
            return "is empty (0 bytes)"
        if name.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                json.load(f)
        elif name.endswith(".safetensors"):
            return _safetensors_problem(path, size)
        elif name.endswith((".bin", ".pt", ".pth")):
            with open(path, "rb") as f:
                head = f.read(len(ZIP_MAGIC))
            if head == ZIP_MAGIC and not zipfile.is_zipfile(path):
                return "is truncated (a torch.save zip without its end record)"
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return f"is unreadable ({type(exc).__name__}: {exc})"
    return None


def _safetensors_problem(path: str, size: int) -> str | None:
    """safetensors: 8-byte header length, JSON header, then the data its offsets end at."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return "is truncated (no header)"
        (n,) = struct.unpack("<Q", raw)
        if 8 + n > size:
            return f"is truncated (header of {n} bytes, file of {size})"
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        return f"is truncated ({8 + n + end} bytes expected, {size} on disk)"
    return None


# ------------------------------------------------------------------------------------------ moves
@dataclass(frozen=True)
class SetAside:
    checkpoint: str  # as it was named
    moved_to: str
    reason: str

    def to_dict(self) -> dict:
        return {"checkpoint": self.checkpoint, "moved_to": self.moved_to, "reason": self.reason}


def set_aside(path: str, run_dir: str, reason: str) -> SetAside:
    """Rename ``path`` into ``run_dir/_incomplete_checkpoints/<its name>.<UTC time>`` and warn (never deletes)."""
    name = os.path.basename(os.path.normpath(path))
    folder = os.path.join(run_dir, INCOMPLETE_DIR)
    os.makedirs(folder, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    dest = os.path.join(folder, f"{name}.{stamp}")
    n = 0
    while os.path.exists(dest):
        n += 1
        dest = os.path.join(folder, f"{name}.{stamp}-{n}")
    os.rename(path, dest)
    _fsync_dir(run_dir)
    logger.warning("hf_speedup crash_safe: %s is incomplete (%s): set aside as %s", path, reason, dest)
    return SetAside(path, dest, reason)


def set_aside_leftovers(run_dir: str) -> list[SetAside]:
    """What unfinished saves and deletions left in ``run_dir``: a staging folder is set aside (its checkpoint
    never became complete), a ``.deleting`` one (a checkpoint rotation had already dropped) is deleted."""
    out: list[SetAside] = []
    try:
        names = sorted(os.listdir(run_dir))
    except FileNotFoundError:
        return out
    for name in names:
        match = LEFTOVER_RE.match(name)
        path = os.path.join(run_dir, name)
        if match is None or not os.path.isdir(path):
            continue
        if match.group(2) == DELETING_SUFFIX:
            logger.info("hf_speedup crash_safe: removing %s, left by a rotation that was stopped", path)
            shutil.rmtree(path, ignore_errors=True)
            continue
        out.extend(discard_staging(path, run_dir, "its save did not finish (the process was stopped while "
                                                  "writing it)", keep=True))
    return out


def discard_staging(root: str, run_dir: str, reason: str, keep: bool) -> list[SetAside]:
    """A staging folder whose save will never finish: set aside (``keep``) or deleted (frees a full disk)."""
    if not keep:
        shutil.rmtree(root, ignore_errors=True)
        logger.warning("hf_speedup crash_safe: removed the unfinished %s (%s)", root, reason)
        return []
    inner = [os.path.join(root, n) for n in sorted(os.listdir(root))] if os.path.isdir(root) else []
    out = [set_aside(p, run_dir, reason) for p in inner if os.path.isdir(p)]
    shutil.rmtree(root, ignore_errors=True)  # empty now (or holding stray files of no checkpoint)
    return out


def remove(path: str, run_dir: str) -> None:
    """Delete ``checkpoint-N`` so that a kill midway leaves no ``checkpoint-N`` behind: rename, then delete."""
    doomed = os.path.join(run_dir, f"_{os.path.basename(os.path.normpath(path))}{DELETING_SUFFIX}")
    if os.path.exists(doomed):
        shutil.rmtree(doomed, ignore_errors=True)
    os.rename(path, doomed)
    _fsync_dir(run_dir)
    shutil.rmtree(doomed, ignore_errors=True)


def commit(root: str, name: str, run_dir: str) -> str:
    """Flush ``root/name`` to disk and rename it to ``run_dir/name``; returns the final path.

    A ``run_dir/name`` already there (the same step saved again, or transformers' JIT checkpoint folder
    holding only its sentinel) is renamed away first and deleted after. With ``save_on_each_node`` on a shared
    file system each node's saving process gets here, one after another (``crash_safe``): the first renames, the
    others find it done (never side by side: a second one could take the fresh folder for the stale one)."""
    staged = os.path.join(root, name)
    final = os.path.join(run_dir, name)
    try:
        inode = os.stat(staged).st_ino
    except FileNotFoundError:
        if os.path.isdir(final):
            return final
        raise
    fsync_tree(staged)
    if os.path.lexists(final) and os.stat(final).st_ino != inode:
        remove(final, run_dir)
    try:
        os.rename(staged, final)
    except FileNotFoundError:
        if not (os.path.isdir(final) and os.stat(final).st_ino == inode):
            raise
    _fsync_dir(run_dir)
    try:
        os.rmdir(root)
    except OSError:
        pass
    return final


def fsync_tree(root: str) -> None:
    """Every file, then every folder, bottom up: the bytes before the names that point at them."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            try:
                fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            except FileNotFoundError:  # another node's saving process renamed the folder meanwhile
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(folder)


def _fsync_dir(path: str) -> None:
    """A folder's entries to disk; skipped where the platform cannot (Windows, some network file systems)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF, errno.EACCES, getattr(errno, "ENOTSUP", errno.EINVAL)):
            raise
    finally:
        os.close(fd)
