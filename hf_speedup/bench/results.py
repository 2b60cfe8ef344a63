"""From step times to the table: steady-state figures, ratios to ``stock``, MFU, cold start, loss.

- tokens/s: non-padding tokens over the steady steps (after ``warmup``) divided by their seconds;
- x stock: the median over steady steps of (tokens/s of the variant at step i) / (tokens/s of ``stock`` at
  step i), with its interquartile range: steps i ran back to back in lock step, so the ratio of each pair
  is robust to the drift of a shared machine;
- step time: the median steady step;
- peak memory: CUDA ``max_memory_allocated`` on GPU; on CPU live tensor bytes of one tracked step
  (torch's MemTracker) and, beside it, the process's peak RSS;
- MFU: PaLM FLOPs per token (``report.measure.flops_per_token``, S the token-weighted mean sequence length) x
  tokens/s / peak FLOP/s of the dtype in use; empty where the peak is unknown (CPUs, unless
  ``HF_SPEEDUP_PEAK_FLOPS`` is set);
- model FLOP/s: the same FLOPs per token x tokens/s, achieved; % matmul peak: model FLOP/s over this machine's
  matmul peak (a large GEMM in the variant's dtype, timed in the worker, the best this machine has shown
  kept; empty with ``HF_SPEEDUP_MEASURE=0``): the step against what this device really delivers, where MFU has no peak;
- breakdown (``--breakdown``): one extra step under torch.profiler, its time by bucket (matmul, attention,
  loss, optimizer, data, compiled, elementwise, overhead), in ``bench.json`` and the notes;
- whole run: process start to the end of the last timed step (set-up, cold compile, every recompile and every
  step), and the tokens of all timed steps over it (whole-run tokens/s, beside the steady figure);
- goodput: the productive part of the whole run: the timed steps' seconds less what of them waited for data
  (the trainer's ``get_batch_samples``), was blocked by saves and compiled (dynamo's compile seconds), over whole
  run s; save-blocked s: the saves' part (0 unless the variant saves: the bench's own runs do not);
- cold start: process start to the end of step 1 with empty compile caches (imports, model, trainer,
  compile and the first step);
- loss: the mean training loss of the last ``max(1, steps // 5)`` steps, and its difference from stock's
  (every variant trains on the same batches in the same order).
"""

from __future__ import annotations

import math
import statistics

from ..features.profile.breakdown import breakdown_lines
from ..report.measure import flops_per_token
from .options import LORA_REFERENCE, REFERENCE, BenchOptions, preset_config

COLUMNS = ("variant", "tokens/s", "x stock (IQR)", "step ms", "whole run s", "whole-run tokens/s", "goodput",
           "save-blocked s", "peak mem MiB", "peak RSS MiB", "model GFLOP/s", "% matmul peak", "MFU", "cold start s",
           "loss", "Δ loss")


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(p25, median, p75); a single value is all three."""
    if len(values) == 1:
        return values[0], values[0], values[0]
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q2, q3


def uses_lora(row: dict, options: BenchOptions) -> bool:
    if row["name"] in (LORA_REFERENCE, "unsloth"):
        return True
    if row["kind"] != "preset":
        return False
    try:
        return bool(preset_config(row["name"]).lora.enabled)
    except Exception:  # noqa: BLE001 - an invalid spec never gets here (validated first)
        return False


def step_rates(row: dict, options: BenchOptions, fallback_tokens: list[int] | None) -> list[float] | None:
    """Tokens/s of each of the ``steps`` timed steps (custom variants use the reference's tokens)."""
    seconds = row["seconds"][: options.steps]
    tokens = (row.get("result") or {}).get("tokens") or fallback_tokens
    if not tokens or len(seconds) < options.steps:
        return None
    return [t / s if s > 0 else float("nan") for t, s in zip(tokens[: options.steps], seconds)]


def ratio_stats(rates: list[float], reference: list[float], warmup: int) -> dict:
    pairs = [a / b for a, b in zip(rates[warmup:], reference[warmup:]) if b > 0]
    p25, median, p75 = quartiles(pairs)
    return {"median": median, "p25": p25, "p75": p75, "pairs": len(pairs)}


def summarize(rows: dict[str, dict], options: BenchOptions) -> list[dict]:
    """One entry per variant, in table order, with every derived figure (None where it does not apply)."""
    warmup, n = options.warmup_steps, options.steps
    ref = rows.get(REFERENCE, {})
    ref_tokens = (ref.get("result") or {}).get("tokens")
    rates = {name: step_rates(row, options, ref_tokens) if row["status"] == "ok" else None
             for name, row in rows.items()}
    ref_loss = (ref.get("result") or {}).get("loss")
    out = []
    for name, row in rows.items():
        entry = {k: row.get(k) for k in ("name", "kind", "status", "reason", "log")}
        if row["status"] != "ok" or rates[name] is None:
            if row["status"] == "ok":
                entry.update(status="failed", reason="fewer timed steps than --steps")
            out.append(entry)
            continue
        result = row["result"]
        seconds = row["seconds"][:n]
        steady = seconds[warmup:]
        tokens = (result.get("tokens") or ref_tokens)[:n]
        steady_tokens = sum(tokens[warmup:])
        tps = steady_tokens / sum(steady)
        metrics = {
            "tokens_per_second": tps,
            "step_time_s": statistics.median(steady),
            "step_time_p25_s": quartiles(steady)[0], "step_time_p75_s": quartiles(steady)[2],
            "steady_steps": len(steady),
            "tokens_counted": sum(tokens) if result.get("tokens") else None,
            "setup_s": row.get("setup_s"),
            "first_step_s": seconds[0],
            "cold_start_s": (row.get("setup_s") or 0.0) + seconds[0],
            "whole_run_s": (row.get("setup_s") or 0.0) + sum(seconds),
            "whole_run_tokens_per_second": sum(tokens) / ((row.get("setup_s") or 0.0) + sum(seconds)),
            **whole_run_split(result.get("step_split"), seconds, (row.get("setup_s") or 0.0) + sum(seconds)),
            "page_faults_per_step": statistics.median(row["faults"][warmup:n]) if row["faults"][warmup:n] else None,
            "peak_memory_bytes": result.get("peak_memory_bytes"),
            "peak_memory_source": result.get("peak_memory_source"),
            "peak_rss_bytes": result.get("peak_rss_bytes"),
            "loss": result.get("loss"),
            "loss_vs_stock": (result["loss"] - ref_loss) if result.get("loss") is not None and ref_loss is not None
            else None,
        }
        if rates.get(REFERENCE):
            metrics["x_stock"] = ratio_stats(rates[name], rates[REFERENCE], warmup)
        if rates.get(LORA_REFERENCE) and name != LORA_REFERENCE and uses_lora(row, options):
            metrics["x_stock_peft"] = ratio_stats(rates[name], rates[LORA_REFERENCE], warmup)
        if result.get("layers") is not None and result.get("tokens"):
            seq = result.get("attention_length") or sum(tokens) / (len(tokens) * options.batch_size)
            fpt = flops_per_token(result["matmul_trainable"], result["matmul_frozen"], result["layers"],
                                  result["attention_width"], seq)
            metrics["flops_per_token"] = fpt
            metrics["mfu"] = fpt * tps / result["peak_flops"] if result.get("peak_flops") else None
            metrics["mfu_reason"] = result.get("peak_flops_source")
            metrics["model_flops_per_second"] = fpt * tps
            peak = result.get("matmul_peak_flops")
            metrics["matmul_peak_flops_per_second"] = peak
            metrics["matmul_peak_source"] = result.get("matmul_peak_source")
            metrics["fraction_of_matmul_peak"] = fpt * tps / peak if peak else None
        if result.get("time_breakdown") is not None:
            metrics["time_breakdown"] = result["time_breakdown"]
        entry["metrics"] = metrics
        entry["worker"] = {k: v for k, v in result.items() if k != "tokens"}
        entry["steps"] = {"seconds": row["seconds"], "tokens": result.get("tokens")}
        out.append(entry)
    return out


def whole_run_split(split: dict | None, seconds: list[float], whole: float) -> dict:
    """Goodput and the unproductive seconds of the timed steps (empty where the worker did not split them: custom
    variants)."""
    n = len(seconds)
    if not split or any(len(split.get(k) or ()) < n for k in ("data", "save", "compile")):
        return {}
    data, save, compiled = (sum(split[k][:n]) for k in ("data", "save", "compile"))
    productive = max(0.0, sum(seconds) - data - save - compiled)
    return {"goodput": productive / whole if whole > 0 else None, "productive_step_s": productive,
            "save_blocked_s": save, "data_wait_s": data, "compile_s": compiled}


# ------------------------------------------------------------------------------------------- table
def _num(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def _delta(value) -> str:
    return "" if value is None else f"{0.0 if abs(value) < 5e-5 else value:+.4f}"


def _mib(value) -> str:
    return "" if value is None else f"{value / 2**20:,.1f}"


def table_rows(entries: list[dict]) -> list[list[str]]:
    rows = []
    for e in entries:
        if e["status"] != "ok":
            rows.append([e["name"], f"{e['status']}: {e.get('reason') or ''}"] + [""] * (len(COLUMNS) - 2))
            continue
        m = e["metrics"]
        x = m.get("x_stock")
        ratio = f"{x['median']:.2f} ({x['p25']:.2f}-{x['p75']:.2f})" if x else ""
        mfu = f"{100 * m['mfu']:.1f}%" if m.get("mfu") is not None else ""
        flops = m.get("model_flops_per_second")
        matmul = m.get("fraction_of_matmul_peak")
        rows.append([e["name"], f"{m['tokens_per_second']:,.0f}", ratio, f"{1e3 * m['step_time_s']:.1f}",
                     _num(m.get("whole_run_s"), ".1f"), _num(m.get("whole_run_tokens_per_second"), ",.0f"),
                     f"{100 * m['goodput']:.1f}%" if m.get("goodput") is not None else "",
                     _num(m.get("save_blocked_s"), ".2f"),
                     _mib(m.get("peak_memory_bytes")), _mib(m.get("peak_rss_bytes")),
                     _num(flops / 1e9 if flops is not None else None, ",.1f"),
                     f"{100 * matmul:.1f}%" if matmul is not None else "", mfu,
                     _num(m.get("cold_start_s"), ".1f"), _num(m.get("loss"), ".4f"),
                     _delta(m.get("loss_vs_stock"))])
    return rows


def markdown_table(entries: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(entries)]
    return "\n".join(lines)


def notes(entries: list[dict], options: BenchOptions, device: str) -> list[str]:
    """What a reader needs beside the numbers: references, measurement sources, anything odd."""
    out = [f"x stock: median over {options.steps - options.warmup_steps} steady steps of the per-step ratio of "
           f"tokens/s to stock's (first {options.warmup_steps} step(s) left out), interquartile range in brackets."]
    ok = [e for e in entries if e["status"] == "ok"]
    if any(e["metrics"].get("goodput") is not None for e in ok):
        out.append("goodput: the timed steps' seconds less their wait for data, saves and compiling, over whole run s; "
                   "save-blocked s: the saves' part of it.")
    if device == "cuda":
        out.append("peak mem: CUDA max_memory_allocated over the run.")
    else:
        out.append("peak mem: live tensor bytes of one extra tracked step (torch MemTracker; that step runs eager, "
                   "so compiled variants show their eager footprint); peak RSS: the worker process's.")
    if ok and all(e["metrics"].get("mfu") is None for e in ok):
        reason = next((e["metrics"].get("mfu_reason") for e in ok if e["metrics"].get("mfu_reason")), None)
        out.append(f"MFU: empty, {reason or 'peak FLOP/s unknown'}.")
    peaks = {(e["worker"].get("compute_dtype"), e["metrics"].get("matmul_peak_source")) for e in ok
             if e["metrics"].get("matmul_peak_source")}
    for dtype, source in sorted(peaks, key=str):
        out.append(f"% matmul peak ({dtype}): model FLOP/s over {source}.")
    for e in ok:
        split = e["metrics"].get("time_breakdown") or {}
        if split.get("steps"):
            out.append(f"{e['name']}: one profiled step of {split['step_ms']:,.1f} ms (under the profiler): "
                       + ", ".join(breakdown_lines(split)) + ".")
        elif split:
            out.append(f"{e['name']}: no breakdown ({split.get('reason')}).")
    out.append(f"loss: mean training loss of steps {options.steps - options.loss_window + 1}-{options.steps} "
               "(same batches, same order for every variant); Δ loss = variant - stock.")
    ref_tokens = next((e["metrics"].get("tokens_counted") for e in ok if e["name"] == REFERENCE), None)
    for e in ok:
        m = e["metrics"]
        if m.get("x_stock_peft"):
            x = m["x_stock_peft"]
            out.append(f"{e['name']} x stock-peft (the stock Trainer on peft with the same adapters): "
                       f"{x['median']:.2f} ({x['p25']:.2f}-{x['p75']:.2f}).")
        counted = m.get("tokens_counted")
        if ref_tokens and counted and abs(counted - ref_tokens) > 0.005 * ref_tokens:
            out.append(f"{e['name']}: counted {counted:,} tokens where stock counted {ref_tokens:,} (different "
                       "batches, or padding counted as tokens): its tokens/s is not like for like.")
        recompiles = (e.get("worker") or {}).get("compile", {}).get("recompiles")
        if recompiles:
            out.append(f"{e['name']}: {recompiles} recompile(s) during the run (new shapes); each one is a slow step.")
        plan = (e.get("worker") or {}).get("plan")
        if plan:
            unique: dict = {}
            for key, value in plan.items():  # report aliases (empty_cache = memory) once
                if value not in unique.values():
                    unique[key] = value
            plan = unique
            engaged = [k for k, v in plan.items() if v.get("engaged")]
            fallbacks = [f"{k}: {fb}" for k, v in plan.items() for fb in v.get("fallbacks") or []]
            out.append(f"{e['name']}: engaged {', '.join(engaged) or 'nothing'}"
                       + (f"; fallbacks: {'; '.join(fallbacks)}" if fallbacks else "") + " (plan in bench.json).")
    return out


def all_finite(entries: list[dict]) -> bool:
    """Every number of every run variant is finite (None is allowed: not applicable here)."""
    def walk(value) -> bool:
        if isinstance(value, bool) or value is None or isinstance(value, str):
            return True
        if isinstance(value, (int, float)):
            return math.isfinite(value)
        if isinstance(value, dict):
            return all(walk(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return all(walk(v) for v in value)
        return True

    return all(walk(e.get("metrics", {})) for e in entries)
