"""The table as a picture: throughput against stock, peak memory, cold start and loss per variant."""

from __future__ import annotations

import logging

logger = logging.getLogger("hf_speedup")


def plot(entries: list[dict], path: str, title: str = "") -> str | None:
    """Write a PNG; returns why not when matplotlib is missing (the plot extra), else None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        why = "PNG not written: matplotlib is not installed (pip install 'hf_speedup[plot]')"
        logger.warning("hf_speedup bench: %s", why)
        return why
    ok = [e for e in entries if e["status"] == "ok"]
    names = [e["name"] for e in ok]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))

    def bars(ax, values, label, errors=None, line=None):
        xs = range(len(names))
        heights = [v if v is not None else 0.0 for v in values]
        ax.bar(xs, heights, yerr=errors, capsize=3, color="#4c72b0")
        if line is not None:
            ax.axhline(line, color="grey", lw=1, ls="--")
        ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(label, fontsize=10)

    ratios = [(e["metrics"].get("x_stock") or {}) for e in ok]
    errors = [[r.get("median", 0) - r.get("p25", 0) for r in ratios], [r.get("p75", 0) - r.get("median", 0) for r in ratios]]
    bars(axes[0][0], [r.get("median") for r in ratios], "tokens/s x stock (median of step ratios, IQR)", errors, 1.0)
    bars(axes[0][1], [(e["metrics"].get("peak_memory_bytes") or 0) / 2**20 for e in ok], "peak memory, MiB")
    bars(axes[1][0], [e["metrics"].get("cold_start_s") for e in ok], "cold start to end of step 1, s")
    bars(axes[1][1], [e["metrics"].get("loss_vs_stock") for e in ok], "loss - stock's loss (same batches)", line=0.0)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
