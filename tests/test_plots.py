"""benchmarks/plots.py: the docs' pictures redrawn from the results recorded under benchmarks/results/."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PNG = b"\x89PNG\r\n\x1a\n"


def _plots():
    spec = importlib.util.spec_from_file_location("plots", ROOT / "benchmarks" / "plots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recorded(pattern: str) -> dict:
    (path,) = sorted(RESULTS.glob(pattern))
    return json.loads(path.read_text())


def test_the_command_draws_every_picture_from_the_recorded_results(tmp_path):
    env = {**os.environ, "MPLBACKEND": "Agg"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plots.py"), "--results", str(RESULTS),
                          "--out", str(tmp_path / "img"), "--markdown", str(tmp_path / "plots.md")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    names = {"bench_throughput_memory.png", "bench_time_split.png", "estimate_vs_measured.png"}
    assert {p.name for p in (tmp_path / "img").iterdir()} == names
    for name in names:
        data = (tmp_path / "img" / name).read_bytes()
        assert data.startswith(PNG) and len(data) > 20_000, (name, len(data))
    text = (tmp_path / "plots.md").read_text()
    assert all(f"](img/{name})" in text for name in names)
    assert "AMD EPYC" in text and "torch 2." in text and "batch 8" in text


def test_the_throughput_bars_are_the_recorded_numbers(tmp_path):
    plots, bench = _plots(), _recorded("bench_*.json")
    data = plots.plot_throughput_memory(bench, tmp_path / "a.png")
    ran = [v for v in bench["variants"] if v["status"] == "ok"]
    assert data["drawn"]["names"] == [v["name"] for v in ran] and "stock" in data["drawn"]["names"]
    assert data["drawn"]["tokens_per_second"] == pytest.approx([v["metrics"]["tokens_per_second"] for v in ran])
    assert data["drawn"]["peak_memory_mib"] == pytest.approx(
        [v["metrics"]["peak_memory_bytes"] / 2**20 for v in ran])
    assert set(data["not_run"]) == {v["name"] for v in bench["variants"] if v["status"] != "ok"}


def test_the_time_split_adds_up_to_set_up_plus_the_timed_steps(tmp_path):
    plots, bench = _plots(), _recorded("bench_*.json")
    data = plots.plot_time_split(bench, tmp_path / "b.png")
    steps = bench["options"]["steps"]
    for i, v in enumerate(v for v in bench["variants"] if v["status"] == "ok"):
        whole = data["setup_s"][i] + data["compile_s"][i] + data["steps_s"][i]
        assert whole == pytest.approx(v["metrics"]["setup_s"] + sum(v["steps"]["seconds"][:steps]))
        assert data["compile_s"][i] == pytest.approx(v["worker"]["compile"]["compile_seconds"])
    assert max(data["compile_s"]) > 0  # stock-compile compiled: the picture has something to show


def test_the_estimate_side_sums_to_the_estimate_and_the_measured_side_to_memtracker(tmp_path):
    plots, est = _plots(), _recorded("estimate_vs_memtracker*.json")
    rows = plots.plot_estimate_vs_measured(est, tmp_path / "c.png")["rows"]
    assert len(rows) == len(est["rows"]) >= 3
    for row, recorded in zip(rows, est["rows"]):
        assert sum(row["estimate"].values()) == pytest.approx(row["estimate_total_mib"]) == pytest.approx(
            recorded["estimate"] / 2**20)
        assert sum(row["measured"].values()) == pytest.approx(recorded["measured"] / 2**20, rel=1e-3)


def test_missing_results_name_the_file_and_the_way_to_make_it(tmp_path):
    with pytest.raises(SystemExit, match=r"no bench_\*\.json under .*benchmarks/results/README.md"):
        _plots().main(["--results", str(tmp_path), "--out", str(tmp_path / "img")])
