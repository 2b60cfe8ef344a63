"""The parent: one fresh worker process per variant, driven in lock step (or one after another).

Lock step (CPU default): the workers are set up one at a time (so each set-up and first step is timed
alone, with a fresh compile cache: the cold start), then step i of every variant runs back to back while
the others wait. Drift of a shared machine hits every variant alike, and the median of per-step ratios
is robust to it. Sequential (GPU default: one GPU rarely holds every variant's model at once): each
variant runs start to finish before the next starts.

A variant that cannot run here (no CUDA, not installed) is a row with the reason; one that fails is a
row with its error and the path of its log. Neither stops the others.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

from .options import BenchOptions, variant_kind


class WorkerFailed(Exception):
    pass


def unavailable(name: str, kind: str, device: str) -> str | None:
    """Why a peer cannot run here, or None (checked before any process starts)."""
    if kind != "peer":
        return None
    if name == "trl-sft" and importlib.util.find_spec("trl") is None:
        return "trl is not installed (pip install 'hf_speedup[trl]': trl==1.16.0, the release tested)"
    if name in ("liger", "unsloth"):
        package = {"liger": "liger_kernel", "unsloth": "unsloth"}[name]
        if device != "cuda":
            return f"{name} runs on CUDA only (Triton kernels); this run is on {device}"
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed (pip install {package.replace('_', '-')})"
    return None


def boot_code(name: str) -> str:
    """Unsloth patches transformers when imported, so its worker imports it before anything else."""
    first = "import unsloth; " if name == "unsloth" else ""
    return f"{first}import sys; from hf_speedup.bench.worker import main; main(sys.argv[1:])"


def slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


class Worker:
    """One variant's process, its message pipe and its log."""

    def __init__(self, name: str, spec: dict, output: str):
        self.name = name
        self.log_path = os.path.join(output, "logs", f"{slug(name)}.log")
        spec_path = os.path.join(output, "logs", f"{slug(name)}.spec.json")
        with open(spec_path, "w") as fh:
            json.dump(spec, fh, indent=1)
        self.cache = tempfile.mkdtemp(prefix=f"hf_speedup_bench_{slug(name)}_")
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=self.cache, TRITON_CACHE_DIR=os.path.join(self.cache, "triton"),
                   TOKENIZERS_PARALLELISM="false")
        env.setdefault("WANDB_MODE", "disabled")
        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        read_fd, write_fd = os.pipe()
        self.log = open(self.log_path, "w")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-c", boot_code(name), spec_path, str(write_fd)],
                                     stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
                                     pass_fds=(write_fd,), env=env, text=True)
        os.close(write_fd)
        self.messages = os.fdopen(read_fd, "r")

    def send(self, word: str) -> None:
        try:
            self.proc.stdin.write(word + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise WorkerFailed(self._why(f"could not send {word!r}: {exc}")) from None

    def expect(self, event: str, timeout: float) -> dict:
        ready, _, _ = select.select([self.messages], [], [], timeout)
        if not ready:
            self.close()
            raise WorkerFailed(f"no {event!r} within {timeout:.0f} s (timed out; raise --timeout); log: {self.log_path}")
        line = self.messages.readline()
        if not line:
            self.proc.wait(timeout=30)
            raise WorkerFailed(self._why(f"exited with code {self.proc.returncode}"))
        message = json.loads(line)
        if message.get("event") == "error":
            self.close()
            raise WorkerFailed(f"{message.get('error')} (log: {self.log_path})")
        if message.get("event") != event:
            self.close()
            raise WorkerFailed(f"sent {message.get('event')!r} where {event!r} was due (log: {self.log_path})")
        return message

    def _why(self, what: str) -> str:
        self.log.flush()
        try:
            with open(self.log_path) as fh:
                tail = [ln for ln in fh.read().strip().splitlines() if ln.strip()][-3:]
        except OSError:
            tail = []
        return f"{what}: {' | '.join(tail)} (log: {self.log_path})"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        for fh in (self.proc.stdin, self.messages, self.log):
            try:
                fh.close()
            except Exception:  # noqa: BLE001 - closing what may already be gone
                pass
        shutil.rmtree(self.cache, ignore_errors=True)


def worker_spec(options: BenchOptions, name: str, device: str, output: str, rows_file: str | None = None) -> dict:
    track = device != "cuda"
    return {
        "variant": name, "kind": variant_kind(name, options.custom), "slug": slug(name),
        "custom": options.custom.get(name), "options": options.to_dict(), "device": device,
        "bf16": options.bf16(device), "output": output, "warmup": options.warmup_steps,
        "loss_window": options.loss_window, "track_memory": track, "breakdown": options.breakdown,
        "total_steps": options.steps + (1 if track else 0) + (1 if options.breakdown else 0), "rows_file": rows_file,
    }


class Run:
    """The state of every variant while the workers run: step seconds, faults, set-up time, result."""

    def __init__(self, options: BenchOptions, device: str, output: str, say=print, rows_file: str | None = None):
        self.options, self.device, self.output, self.say = options, device, output, say
        self.rows_file = rows_file  # rows made once by the parent (docs-chat), or None: each worker makes them
        self.names = options.with_reference()
        self.rows: dict[str, dict] = {n: {"name": n, "kind": variant_kind(n, options.custom), "status": "pending",
                                          "seconds": [], "faults": []} for n in self.names}
        self.workers: dict[str, Worker] = {}
        self.total_steps = options.steps + (0 if device == "cuda" else 1) + (1 if options.breakdown else 0)

    # ----------------------------------------------------------------------------- one worker
    def fail(self, name: str, why: str) -> None:
        row = self.rows[name]
        row["status"], row["reason"] = "failed", why
        worker = self.workers.pop(name, None)
        if worker is not None:
            worker.close()
        self.say(f"  {name}: failed: {why}")

    def exchange(self, name: str, worker: Worker, event: str, word: str | None = None) -> dict | None:
        """Send ``word`` (if any) to the worker and wait for its ``event``; None when that failed (the variant's row
        then says why and its worker is gone)."""
        try:
            if word is not None:
                worker.send(word)
            return worker.expect(event, self.options.timeout)
        except WorkerFailed as exc:
            self.fail(name, str(exc))
            return None

    def start(self, name: str) -> None:
        worker = Worker(name, worker_spec(self.options, name, self.device, self.output, self.rows_file), self.output)
        self.workers[name] = worker
        if self.exchange(name, worker, "ready") is None:
            return
        self.rows[name]["setup_s"] = time.perf_counter() - worker.started
        self.rows[name]["status"] = "running"
        self.say(f"  {name}: ready after {self.rows[name]['setup_s']:.1f} s", flush=True)

    def step(self, name: str) -> None:
        worker = self.workers.get(name)
        if worker is None:
            return
        message = self.exchange(name, worker, "step", "go")
        if message is None:
            return
        self.rows[name]["seconds"].append(float(message["seconds"]))
        self.rows[name]["faults"].append(int(message["faults"]))

    def finish(self, name: str) -> None:
        worker = self.workers.get(name)
        if worker is None:
            return
        message = self.exchange(name, worker, "done", "finish")
        if message is None:
            return
        self.rows[name].update(status="ok", result=message["result"], log=worker.log_path)
        worker.close()
        del self.workers[name]

    # ----------------------------------------------------------------------------- schedules
    def lockstep(self, names: list[str]) -> None:
        for name in names:
            self.start(name)
        for i in range(self.total_steps):
            for name in names:
                self.step(name)
            self._progress(i + 1, names)
        for name in names:
            self.finish(name)

    def sequential(self, names: list[str]) -> None:
        for name in names:
            self.start(name)
            for i in range(self.total_steps):
                self.step(name)
            self.finish(name)
            row = self.rows[name]
            if row["status"] == "ok":
                self.say(f"  {name}: done ({len(row['seconds'])} steps)", flush=True)

    def _progress(self, i: int, names: list[str]) -> None:
        if i % 10 and i != self.total_steps:
            return
        import statistics

        parts = [f"{n} {1e3 * statistics.median(self.rows[n]['seconds']):.0f} ms" for n in names
                 if self.rows[n]["seconds"]]
        self.say(f"  step {i}/{self.total_steps}: median so far " + "  ".join(parts), flush=True)

    def close(self) -> None:
        for name in list(self.workers):
            self.workers.pop(name).close()


def run_variants(options: BenchOptions, device: str, output: str, say=print,
                 rows_file: str | None = None) -> dict[str, dict]:
    """Run every variant; returns the raw per-variant rows (status, step seconds, worker result)."""
    os.makedirs(os.path.join(output, "logs"), exist_ok=True)
    run = Run(options, device, output, say, rows_file)
    runnable = []
    for name in run.names:
        why = unavailable(name, run.rows[name]["kind"], device)
        if why:
            run.rows[name].update(status="not run", reason=why)
        else:
            runnable.append(name)
    schedule = options.resolved_schedule(device)
    say(f"running {', '.join(runnable)} ({schedule}, {options.steps} steps each, {device})", flush=True)
    try:
        (run.lockstep if schedule == "lockstep" else run.sequential)(runnable)
    finally:
        run.close()
    return run.rows

