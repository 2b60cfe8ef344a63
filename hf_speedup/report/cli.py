"""What ``hf-speedup report`` does: print a report, plot it, compare several runs.

Each argument is a ``speedup_report.json`` or a run directory (a training ``output_dir``) holding one.
"""

from __future__ import annotations

from pathlib import Path

from .console import compare_table, metrics_table, plan_table
from .schema import load_report


class ReportInputError(ValueError):
    """A report that cannot be read (missing, not JSON, not an hf_speedup report) or plotted: the user's
    input, so ``hf-speedup report`` prints it as one line instead of a traceback."""


_SECTIONS = {"plan": dict, "metrics": dict, "measurement": dict, "environment": dict, "capabilities": dict,
             "history": list, "step_times": list}


def read_report(path: str | Path) -> dict:
    """``load_report`` with every way a path can be wrong turned into :class:`ReportInputError`, including
    a JSON file whose sections do not have the report's shape (the tables would fail on it later)."""
    try:
        report = load_report(path)
    except (OSError, ValueError) as exc:  # missing, a directory without one, unreadable, not JSON, no plan
        raise ReportInputError(str(exc)) from None
    where = report.get("_path", path)
    for key, kind in _SECTIONS.items():
        if report.get(key) is not None and not isinstance(report[key], kind):
            raise ReportInputError(f"{where} is not an hf_speedup report: '{key}' is a {type(report[key]).__name__}, "
                                   f"not a {'mapping' if kind is dict else 'list'}")
    bad = [k for k, v in report["plan"].items() if not isinstance(v, dict)]
    if bad:
        raise ReportInputError(f"{where} is not an hf_speedup report: plan entries {bad} are not mappings of "
                               "requested/applied/engaged/reason")
    return report


def _label(report: dict, taken: set[str]) -> str:
    """Short column name of a run: its directory name, else the preset; made unique."""
    path = report.get("_path")
    base = Path(path).parent.name if path else ""
    label = base or str(report.get("preset") or "run")
    out, i = label, 2
    while out in taken:
        out, i = f"{label}#{i}", i + 1
    taken.add(out)
    return out


def format_report(report: dict, width: int = 80) -> str:
    """The plan table and the metrics table of one report dict, plus the versions."""
    env = report.get("environment") or {}
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "transformers", "accelerate", "peft", "bitsandbytes")
                         if env.get(k))
    parts = [plan_table(report, width), "", metrics_table(report, width)]
    if versions:
        import textwrap

        parts += ["", *textwrap.wrap("versions: " + versions, width)]
    return "\n".join(parts)


def print_report(path: str | Path, width: int = 80) -> str:
    """Print the report at ``path`` (JSON file or run directory); returns the printed text."""
    text = format_report(read_report(path), width=width)
    print(text)
    return text


def compare_reports(paths: list[str | Path], width: int = 80) -> str:
    """Print several runs side by side (per feature: engaged or not; then the metrics); returns the text."""
    if not paths:
        raise ReportInputError("compare needs at least one report (a JSON file or run directory)")
    reports = [read_report(p) for p in paths]
    taken: set[str] = set()
    labels = [_label(r, taken) for r in reports]
    text = compare_table(reports, labels, width=width)
    print(text)
    return text


def plot_report(path: str | Path, out_png: str | Path) -> Path:
    """Draw throughput, step time and memory over the steps of one run into ``out_png`` (matplotlib, Agg)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:  # pragma: no cover - optional dependency
        raise ReportInputError("plotting needs matplotlib; fix: pip install 'hf_speedup[plot]'") from None

    report = read_report(path)
    history = report.get("history") or []
    step_times = report.get("step_times") or []
    metrics = report.get("metrics") or {}
    x = report.get("measurement") or {}
    env = report.get("environment") or {}
    if not history and not step_times:
        raise ReportInputError(f"{report.get('_path', path)} has no per-step history (was the run trained with "
                         f"SpeedupTrainer and at least one logging step?)")

    fig, axes = plt.subplots(3, 1, figsize=(9, 8.5), sharex=True, constrained_layout=True)
    ax_tp, ax_st, ax_mem = axes
    engaged = [f for f, d in (report.get("plan") or {}).items() if d.get("engaged")]
    fig.suptitle(f"hf_speedup — preset '{report.get('preset')}' on {env.get('device_name', '?')}\n"
                 f"engaged: {', '.join(engaged) or 'none'}", fontsize=11)

    # throughput per logging window, with the steady-state value as a reference line
    hs = [h["step"] for h in history if h.get("tokens_per_second") is not None]
    tps = [h["tokens_per_second"] for h in history if h.get("tokens_per_second") is not None]
    if hs:
        ax_tp.plot(hs, tps, marker="o", ms=3, lw=1.5, label="per logging window")
    if metrics.get("tokens_per_second"):
        ax_tp.axhline(metrics["tokens_per_second"], color="tab:green", ls="--", lw=1,
                      label=f"steady state {metrics['tokens_per_second']:,.0f} tok/s")
    ax_tp.set_ylabel("tokens / s\n(non-padding, all ranks)")
    ax_tp.set_ylim(bottom=0)
    ax_tp.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax_tp.legend(loc="lower right", fontsize=8)
    ax_tp.grid(alpha=0.3)

    # step time per optimizer step
    if step_times:
        s = [r[0] for r in step_times]
        t = [r[1] * 1000 for r in step_times]
        ax_st.plot(s, t, lw=1, color="tab:blue", label="step time")
        steady = metrics.get("step_time_s")
        if steady:
            ax_st.axhline(steady * 1000, color="tab:green", ls="--", lw=1,
                          label=f"steady median {steady * 1000:,.1f} ms")
        steady_vals = sorted(t[1:]) or t
        top = steady_vals[min(len(steady_vals) - 1, int(0.95 * len(steady_vals)))] * 2.0
        if max(t) > top > 0:  # compile steps would flatten the rest: clip and say so
            ax_st.set_ylim(0, top)
            worst = max(step_times, key=lambda r: r[1])
            ax_st.text(0.01, 0.95, f"y clipped: step {worst[0]} took {worst[1]:,.1f} s", transform=ax_st.transAxes,
                       va="top", fontsize=8, color="tab:red")
        else:
            ax_st.set_ylim(bottom=0)
        # steps in which dynamo compiled: shaded on every panel (excluded from the steady state)
        compiled = [r[0] for r in step_times if len(r) > 2 and r[2]]
        for i, step in enumerate(compiled):
            for ax in axes:
                ax.axvspan(step - 0.5, step + 0.5, color="tab:red", alpha=0.18, lw=0,
                           label="compiled in this step" if (i == 0 and ax is ax_st) else None)
    ax_st.set_ylabel("step time (ms)")
    ax_st.legend(loc="upper right", fontsize=8)
    ax_st.grid(alpha=0.3)

    # memory
    gib = 1024 ** 3
    src = x.get("memory_source") or ""
    mh = [h for h in history if h.get("peak_memory_allocated_bytes") is not None]
    if mh:
        steps = [h["step"] for h in mh]
        if "RSS" in src:
            ax_mem.plot(steps, [h["peak_memory_allocated_bytes"] / gib for h in mh], marker="o", ms=3,
                        label="peak RSS")
            ax_mem.plot(steps, [(h.get("memory_allocated_bytes") or 0) / gib for h in mh], ls=":",
                        label="current RSS")
        else:
            ax_mem.plot(steps, [h["peak_memory_allocated_bytes"] / gib for h in mh], marker="o", ms=3,
                        label="peak allocated")
            ax_mem.plot(steps, [h["peak_memory_reserved_bytes"] / gib for h in mh], marker="s", ms=3,
                        label="peak reserved")
            ax_mem.plot(steps, [(h.get("memory_allocated_bytes") or 0) / gib for h in mh], ls=":",
                        label="allocated now")
    ax_mem.set_ylabel(f"memory (GiB)\n{src}")
    peaks = [max(h["peak_memory_allocated_bytes"], h.get("peak_memory_reserved_bytes") or 0) for h in mh]
    top = max(peaks or [0]) / gib
    ax_mem.set_ylim(0, top * 1.2 if top > 0 else 1)
    ax_mem.set_xlabel("optimizer step")
    ax_mem.legend(loc="lower right", fontsize=8)
    ax_mem.grid(alpha=0.3)

    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
