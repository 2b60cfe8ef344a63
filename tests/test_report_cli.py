"""``hf-speedup report`` functions: print, plot, compare — on reports of real runs; console widths."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from hf_speedup.report.console import compare_table, fmt_num, metrics_table, plan_table
from hf_speedup.report import REPORT_FILE, load_report
from hf_speedup.report.cli import compare_reports, format_report, plot_report, print_report

from conftest import REPORTED_BASELINE


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One short real run (8 steps, logging every 2) shared by the tests of this module."""
    from transformers import TrainingArguments

    from hf_speedup import SpeedupTrainer
    from hf_speedup.tiny import causal_lm_collator, char_tokenizer, make_dataset, tiny_llama

    out = tmp_path_factory.mktemp("run") / "baseline-run"
    tok = char_tokenizer()
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, max_steps=8, logging_steps=2,
                             report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
    model = tiny_llama(seed=0, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    SpeedupTrainer(model=model, args=args, train_dataset=make_dataset(tok, n=256, pack_to=64),
                   data_collator=causal_lm_collator(tok), speedup=REPORTED_BASELINE).train()
    return out


def _assert_width(text: str, width: int = 80):
    for line in text.splitlines():
        assert len(line) <= width, f"{len(line)} > {width}: {line!r}"


def test_print_report_from_dir_or_json(run_dir, capsys):
    text = print_report(run_dir)
    assert capsys.readouterr().out.strip() == text.strip()
    assert print_report(run_dir / REPORT_FILE) == text
    report = json.loads((run_dir / REPORT_FILE).read_text())
    lines = text.splitlines()
    for feature, entry in report["plan"].items():  # one row per feature with its engaged state
        if feature == "empty_cache":  # the version-1 alias of "memory": the same entry, shown once
            assert entry == report["plan"]["memory"] and not any(line.startswith("empty_cache ") for line in lines)
            continue
        row = next(line for line in lines if line.startswith(feature + " "))
        assert row.split()[-1] == ("yes" if entry["engaged"] else "no")
    tps = report["metrics"]["tokens_per_second"]
    assert any(line.startswith("tokens/s") and fmt_num(tps) in line for line in lines)
    assert fmt_num(1891.26) == "1,891" and fmt_num(391.26) == "391.3"
    assert "transformers " + report["environment"]["transformers"] in text
    _assert_width(text)


def test_load_report_finds_the_report_below_a_dir_and_explains_failures(run_dir, tmp_path):
    assert load_report(run_dir.parent)["preset"] == "baseline"  # found below the given directory
    with pytest.raises(FileNotFoundError, match="no speedup_report.json in"):
        load_report(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_report(tmp_path / "nope.json")
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"loss": 1}))
    with pytest.raises(ValueError, match="not an hf_speedup report"):
        load_report(bad)


def test_plot_draws_throughput_step_time_and_memory(run_dir, tmp_path):
    import matplotlib.image as mpimg
    import numpy as np

    out = plot_report(run_dir, tmp_path / "plots" / "run.png")
    assert out.is_file() and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(out)
    assert img.shape[0] > 600 and img.shape[1] > 600
    assert float(np.std(img[..., :3])) > 0.05  # not a blank canvas


def test_plot_refuses_a_report_without_history(run_dir, tmp_path):
    report = json.loads((run_dir / REPORT_FILE).read_text())
    report["history"], report["step_times"] = [], []
    path = tmp_path / REPORT_FILE
    path.write_text(json.dumps(report))
    with pytest.raises(ValueError, match="no per-step history"):
        plot_report(path, tmp_path / "x.png")


def _variant(run_dir: Path, tmp_path: Path, name: str, **changes) -> Path:
    """A second run's report: the real one with some features engaged and other numbers."""
    report = json.loads((run_dir / REPORT_FILE).read_text())
    report = copy.deepcopy(report)
    for feature, (engaged, applied) in changes.pop("plan", {}).items():
        report["plan"][feature].update(engaged=engaged, applied=applied)
    report["metrics"].update(changes)
    d = tmp_path / name
    d.mkdir()
    (d / REPORT_FILE).write_text(json.dumps(report))
    return d


def test_compare_shows_what_engaged_and_what_it_bought(run_dir, tmp_path, capsys):
    base = json.loads((run_dir / REPORT_FILE).read_text())
    fast = _variant(run_dir, tmp_path, "fast-run", plan={"compile": (True, "blocks")},
                    tokens_per_second=2 * base["metrics"]["tokens_per_second"],
                    peak_memory_allocated_bytes=base["metrics"]["peak_memory_allocated_bytes"] // 2)
    text = compare_reports([run_dir, fast])
    assert capsys.readouterr().out.strip() == text.strip()
    lines = text.splitlines()
    assert lines[0].split() == ["run", "baseline-run", "fast-run"]
    compile_row = next(line for line in lines if line.strip().startswith("compile "))
    assert compile_row.split()[1:] == ["no", "(off)", "yes", "blocks"]
    speed = next(line for line in lines if "speed vs first" in line)
    assert speed.split()[-2:] == ["x1.00", "x2.00"]
    memory = next(line for line in lines if "memory vs first" in line)
    assert memory.split()[-1] == "x0.50"
    _assert_width(text)


def test_compare_many_runs_wraps_into_blocks_within_80_columns(run_dir, tmp_path):
    runs = [run_dir] + [_variant(run_dir, tmp_path, f"a-rather-long-run-name-{i}") for i in range(5)]
    reports = [load_report(r) for r in runs]
    text = compare_table(reports, [r.name for r in runs], width=80)
    _assert_width(text)
    assert text.count("\nrun ") + text.startswith("run ") >= 2  # more than one block
    for r in runs:  # every run appears (maybe clipped) in a header
        assert r.name[:10] in text


def test_tables_fit_80_columns_with_long_reasons_and_names(tiny_model):
    import dataclasses

    from hf_speedup import plan_for
    from hf_speedup.report import Report
    from tests.conftest import CUDA_H100, fake_caps

    caps = fake_caps(**{**CUDA_H100, "device_name": "NVIDIA H100 80GB HBM3 with an improbably long marketing name"})
    long = {name: d.replace(reason=("a deliberately long reason " * 12).strip(),
                            requested={"very_long_setting_name": "and a long value", "another": [1, 2, 3]})
            for name, d in plan_for("auto", caps, tiny_model).decisions.items()}
    plan = Report(dataclasses.replace(plan_for("auto", caps, tiny_model), decisions=long)).to_dict()
    text = plan_table(plan)
    _assert_width(text)
    assert all(f in text for f in ("precision", "compile", "optimizer", "fsdp"))
    # long values wrap inside their column: nothing is cut off
    assert "~" not in text and "improbably long marketing name" in " ".join(text.split())
    assert "value,another=1,2,3" in text and "very_long_setting_name" in text
    capped = plan_table(plan, max_reason_lines=2)
    assert len(capped.splitlines()) < len(text.splitlines()) and "..." in capped
    _assert_width(capped)

    report = {"preset": "x" * 60, "environment": {"device_name": "GPU " * 20},
              "metrics": {"tokens_per_second": 1.234e9, "step_time_s": 12345.6, "mfu": 0.5,
                          "peak_memory_allocated_bytes": 3 << 40, "total_parameters": 405_000_000_000},
              "measurement": {"steps": 10**7, "steady_state_steps": 10**7 - 3, "peak_flops_per_device": 989e12,
                              "compute_dtype": "bf16", "num_devices": 1024, "peak_flops_source": "table",
                              "memory_source": "cuda caching allocator"}}
    text = metrics_table(report)
    _assert_width(text)
    assert "50.0%" in text and "3.00 TiB" in text
    _assert_width(format_report({**report, "plan": {"compile": {"requested": True, "applied": "blocks",
                                                                "engaged": False, "reason": "r " * 200}}}))
