"""The docs' benchmark pictures, redrawn from the results recorded under benchmarks/results/.

    python benchmarks/plots.py                                   # benchmarks/results -> docs/img
    python benchmarks/plots.py --results DIR --out DIR --markdown benchmarks/results/plots.md

Three PNGs (matplotlib, Agg), each drawn by one function that returns the numbers it drew:

- ``bench_throughput_memory.png`` (``plot_throughput_memory``): tokens/s and peak memory of every preset and
  peer of one ``hf-speedup bench`` run (``bench_*.json``: the run's ``bench.json``);
- ``bench_time_split.png`` (``plot_time_split``): each variant's whole run split into set-up (process start to
  ready), compile (dynamo's own timers) and the rest of its timed steps;
- ``estimate_vs_measured.png`` (``plot_estimate_vs_measured``): ``hf_speedup.estimate_memory``'s breakdown at
  its peak beside torch MemTracker's categories of a real step, per configuration (``estimate_vs_memtracker*.json``,
  written by ``benchmarks/estimate_vs_memtracker.py --json``).

``--markdown`` writes the image links with one-line captions (model, hardware, batch, sequence length, precision,
versions), read from the same files.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
IMAGES = ROOT / "docs" / "img"
MIB = 2**20
ESTIMATE_ITEMS = ("weights", "autocast_weight_copies", "gradients", "optimizer_states", "lora_adapters", "activations",
                  "logits_and_loss", "temporaries")  # hf_speedup.memory_model_types.ITEMS but "overhead" (no tensor)
MEMTRACKER_ITEMS = ("Parameter", "Buffer", "Gradient", "Optstate", "Activation", "Temp", "Other")
COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c", "#ccb974")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ok(bench: dict) -> list[dict]:
    return [v for v in bench["variants"] if v["status"] == "ok"]


def machine_text(machine: dict) -> str:
    flags = ", ".join(f for f, on in (machine.get("cpu_flags") or {}).items() if on)
    hardware = machine.get("gpu") or f"{machine.get('cpu')} CPU, {machine.get('cores')} cores"
    versions = ", ".join(f"{p} {machine[p]}" for p in ("torch", "transformers", "peft", "trl") if machine.get(p))
    return f"{hardware}{f' ({flags})' if flags and not machine.get('gpu') else ''}; {versions}"


def bench_setting(bench: dict) -> str:
    """Model, batch, sequence length and precision of a bench run, in words."""
    o = bench["options"]
    model = o.get("model") or ("a model from --config" if o.get("model_config") else "the embedded tiny Llama")
    rows = ("ragged rows (16 to " + str(min(512, o["seq_len"])) + " tokens)" if o["data"] == "ragged"
            else f"{o['data']} rows")
    precision = {"auto": "fp32" if bench.get("device") != "cuda" else "bf16"}.get(o["precision"], o["precision"])
    return (f"{model}, batch {o['batch_size']} x sequence length up to {o['seq_len']}, {rows}, {o['steps']} steps, "
            f"TrainingArguments {precision} (each preset's precision as its plan says)")


def plot_throughput_memory(bench: dict, path: Path) -> dict:
    """Two bar charts, one bar per variant that ran: steady tokens/s and peak memory (MiB)."""
    plt = _pyplot()
    ok = _ok(bench)
    data = {"names": [v["name"] for v in ok],
            "tokens_per_second": [v["metrics"]["tokens_per_second"] for v in ok],
            "peak_memory_mib": [(v["metrics"].get("peak_memory_bytes") or 0) / MIB for v in ok],
            "not_run": {v["name"]: v.get("reason") for v in bench["variants"] if v["status"] != "ok"}}
    colors = [COLORS[1] if v["kind"] != "preset" else COLORS[0] for v in ok]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    xs = list(range(len(ok)))
    drawn = {}
    for ax, key, title in ((axes[0], "tokens_per_second", "tokens/s (non-padding, steady steps)"),
                           (axes[1], "peak_memory_mib", "peak memory, MiB (" + _memory_source(ok) + ")")):
        bars = ax.bar(xs, data[key], color=colors)
        drawn[key] = [b.get_height() for b in bars]  # what the picture shows, read back from it
        ax.bar_label(bars, fmt="{:,.0f}", fontsize=7)
        ax.set_xticks(xs, data["names"], rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
    axes[0].legend(handles=[plt.Rectangle((0, 0), 1, 1, color=COLORS[0]), plt.Rectangle((0, 0), 1, 1, color=COLORS[1])],
                   labels=["hf_speedup preset", "peer"], fontsize=8, loc="upper left")
    drawn["names"] = [t.get_text() for t in axes[0].get_xticklabels()]
    fig.suptitle(f"{bench_setting(bench)}\n{machine_text(bench['machine'])}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {**data, "drawn": drawn}


def _memory_source(ok: list[dict]) -> str:
    sources = {v["metrics"].get("peak_memory_source") or "" for v in ok}
    return "CUDA max allocated" if any("cuda" in s.lower() for s in sources) else "live tensors, MemTracker"


def time_split(entry: dict, steps: int) -> dict:
    """Set-up, compile and the other step seconds of one variant's run (compile is spent inside the steps)."""
    seconds = sum(entry["steps"]["seconds"][:steps])
    compile_s = min(((entry.get("worker") or {}).get("compile") or {}).get("compile_seconds") or 0.0, seconds)
    return {"setup_s": entry["metrics"].get("setup_s") or 0.0, "compile_s": compile_s, "steps_s": seconds - compile_s}


def plot_time_split(bench: dict, path: Path) -> dict:
    """One horizontal stacked bar per variant: set-up, compile, steps (seconds)."""
    plt = _pyplot()
    ok = _ok(bench)
    split = [time_split(v, bench["options"]["steps"]) for v in ok]
    data = {"names": [v["name"] for v in ok], **{k: [s[k] for s in split] for k in ("setup_s", "compile_s", "steps_s")}}
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(ok) + 1.6))
    left = [0.0] * len(ok)
    for key, label, color in (("setup_s", "set-up (process start to ready)", COLORS[7]),
                              ("compile_s", "compile (dynamo timers)", COLORS[3]),
                              ("steps_s", f"{bench['options']['steps']} steps, compile left out", COLORS[0])):
        ax.barh(data["names"], data[key], left=left, label=label, color=color)
        left = [a + b for a, b in zip(left, data[key])]
    for y, total in enumerate(left):
        ax.text(total, y, f" {total:.1f} s", va="center", fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.legend(fontsize=8, loc="lower right")
    setting = bench_setting(bench).replace(", TrainingArguments", "\nTrainingArguments")
    ax.set_title(f"whole run per variant: {setting}\n{machine_text(bench['machine'])}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return data


def estimate_rows(est: dict) -> list[dict]:
    """Per configuration: the estimate's items (MiB, overhead left out: not a tensor) and MemTracker's (MiB)."""
    out = []
    for r in est["rows"]:
        breakdown = r.get("breakdown") or {}
        predicted = {k: breakdown.get(k, 0) / MIB for k in ESTIMATE_ITEMS}
        predicted["other"] = sum(v for k, v in breakdown.items() if k not in ESTIMATE_ITEMS and k != "overhead") / MIB
        measured = {k: (r["by_category"].get(k) or 0) / MIB for k in MEMTRACKER_ITEMS}
        out.append({"label": f"{r['label']} ({r['model'].split(' (')[0]}, {r['batch']})",
                    "estimate": predicted, "measured": measured,
                    "estimate_total_mib": r["estimate"] / MIB, "measured_total_mib": r["measured"] / MIB})
    return out


# one colour per kind of memory, the same on both bars (the estimate's item and MemTracker's category)
KIND_COLORS = {"weights": 0, "Parameter": 0, "autocast_weight_copies": 1, "gradients": 2, "Gradient": 2,
               "optimizer_states": 3, "Optstate": 3, "activations": 4, "Activation": 4, "temporaries": 5, "Temp": 5,
               "logits_and_loss": 6, "Buffer": 7, "Other": 7, "other": 7, "lora_adapters": 8}


def plot_estimate_vs_measured(est: dict, path: Path) -> dict:
    """Per configuration two stacked bars: the estimate's breakdown at its peak, MemTracker's categories."""
    plt = _pyplot()
    rows = estimate_rows(est)
    fig, ax = plt.subplots(figsize=(12, 0.75 * len(rows) + 3.2))
    ys_est = [2 * i for i in range(len(rows))]
    ys_meas = [y + 0.8 for y in ys_est]
    for ys, side, items in ((ys_est, "estimate", (*ESTIMATE_ITEMS, "other")), (ys_meas, "measured", MEMTRACKER_ITEMS)):
        left = [0.0] * len(rows)
        for item in items:
            widths = [r[side][item] for r in rows]
            if not any(widths):
                continue
            ax.barh(ys, widths, left=left, height=0.75, color=COLORS[KIND_COLORS[item]],
                    hatch=None if side == "estimate" else "//", edgecolor="white",
                    label=f"{'estimate' if side == 'estimate' else 'MemTracker'}: {item}")
            left = [a + b for a, b in zip(left, widths)]
        for y, total in zip(ys, left):
            ax.text(total, y, f" {total:,.1f}", va="center", fontsize=7)
    ax.set_yticks([y + 0.4 for y in ys_est], [r["label"] for r in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("MiB at the peak of one training step (upper bar: estimate_memory; lower, hatched: MemTracker)")
    fig.legend(*ax.get_legend_handles_labels(), fontsize=7, ncol=4, loc="lower center")
    ax.set_title(f"estimate_memory's breakdown against torch MemTracker's categories\n{machine_text(est['machine'])}",
                 fontsize=8)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return {"rows": rows}


def _one(results: Path, pattern: str) -> Path:
    found = sorted(results.glob(pattern))
    if not found:
        raise SystemExit(f"no {pattern} under {results}: see benchmarks/results/README.md for the commands")
    return found[-1]


def markdown(bench: dict, est: dict) -> str:
    """The image links with their captions (for docs/benchmarks.md, "## Plots")."""
    est_models = sorted({r["model"] for r in est["rows"]})
    est_batches = sorted({r["batch"] for r in est["rows"]})
    return "\n".join([
        "![tokens/s and peak memory per preset and peer](img/bench_throughput_memory.png)",
        "",
        f"*`hf-speedup bench`: tokens/s and peak memory of every preset and peer (stock Trainer, TRL) on "
        f"{bench_setting(bench)}; {machine_text(bench['machine'])}.*",
        "",
        "![whole run split into set-up, compile and steps](img/bench_time_split.png)",
        "",
        f"*The same runs' wall clock, split into set-up, compile and steps: {bench_setting(bench)}; "
        f"{machine_text(bench['machine'])}.*",
        "",
        "![estimate_memory's breakdown beside the measured memory](img/estimate_vs_measured.png)",
        "",
        f"*`estimate_memory`'s breakdown at its peak beside torch MemTracker's categories of one real step: "
        f"{'; '.join(est_models)}, micro-batch x sequence length {', '.join(est_batches)}, fp32 unless the row says "
        f"otherwise; {machine_text(est['machine'])}.*",
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=RESULTS, help="folder of the recorded JSON (default: %(default)s)")
    p.add_argument("--out", type=Path, default=IMAGES, help="folder for the PNGs (default: %(default)s)")
    p.add_argument("--markdown", type=Path, help="also write the image links with their captions here")
    ns = p.parse_args(argv)
    bench = json.loads(_one(ns.results, "bench_*.json").read_text())
    est = json.loads(_one(ns.results, "estimate_vs_memtracker*.json").read_text())
    ns.out.mkdir(parents=True, exist_ok=True)
    for name, draw, source in (("bench_throughput_memory.png", plot_throughput_memory, bench),
                               ("bench_time_split.png", plot_time_split, bench),
                               ("estimate_vs_measured.png", plot_estimate_vs_measured, est)):
        draw(source, ns.out / name)
        print(f"wrote {ns.out / name}")
    if ns.markdown:
        ns.markdown.write_text(markdown(bench, est))
        print(f"wrote {ns.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
