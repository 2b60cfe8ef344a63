"""Plain-text tables that fit an 80-column terminal: the plan, the metrics, several runs side by side."""

from __future__ import annotations

import textwrap

from ..memory_model import fmt_bytes as binary_bytes


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, (list, tuple)):
        return ",".join(_cell(x) for x in v) or "-"
    if isinstance(v, dict):
        return ",".join(f"{k}={_cell(x)}" for k, x in v.items()) or "-"
    return str(v)


def _wrap(s: str, w: int) -> list[str]:
    """A cell's lines within width ``w``: wrapped at spaces, long words split; never clipped."""
    return textwrap.wrap(s, max(1, w), break_on_hyphens=False) or [""]


def _rows_of(cells: list[str], widths: list[int]) -> list[str]:
    """One table row as lines: every cell wraps inside its own column."""
    columns = [_wrap(c, w) for c, w in zip(cells, widths)]
    height = max(len(c) for c in columns)
    return ["  ".join((col[i] if i < len(col) else "").ljust(w) for col, w in zip(columns, widths)).rstrip()
            for i in range(height)]


def table(headers: list[str], rows: list[list], widths: list[int]) -> str:
    """Fixed-width table within sum(widths): cells wrap inside their columns instead of being cut."""
    out = _rows_of(headers, widths)
    out.append("  ".join("-" * w for w in widths))
    for row in rows:
        out.extend(_rows_of([_cell(c) for c in row], widths))
    return "\n".join(out)


def _fit(headers: list[str], rows: list[list], caps: list[int], width: int, last_min: int = 20) -> list[int]:
    """Column widths: each leading column as wide as its content (up to its cap), the last gets the rest."""
    widths = []
    for i, cap in enumerate(caps):
        content = max([len(headers[i])] + [len(_cell(r[i])) for r in rows])
        widths.append(min(cap, content))
    widths.append(max(last_min, width - sum(w + 2 for w in widths)))
    return widths


# ------------------------------------------------------------------------------------------ plan
def _engaged_cell(engaged) -> str:
    return "?" if engaged is None else ("yes" if engaged else "no")


ALIASES = {"empty_cache"}  # report keys kept for readers of older reports; the same entry as "memory"


def plan_rows(plan_dict: dict, verified: bool = True) -> list[list]:
    """[feature, requested, applied, engaged, reason] per feature of a ``plan`` dict ("?" before verification)."""
    rows = []
    for feature, d in plan_dict.items():
        if feature in ALIASES:
            continue
        engaged = d.get("engaged") if verified else None
        rows.append([feature, d.get("requested"), d.get("applied"), _engaged_cell(engaged), d.get("reason", "")])
    return rows


def plan_table_rows(title: str, rows: list[list], width: int = 80, max_reason_lines: int | None = None) -> str:
    """One line per feature (requested, applied, engaged), its reason indented below at full width.

    ``max_reason_lines`` caps each reason (the JSON report always has it whole).
    """
    headers = ["feature", "requested", "applied", "engaged"]
    caps = [17, 22, 23, 7]  # the feature column holds the longest name (sequence_parallel)
    widths = [min(cap, max([len(h)] + [len(_cell(r[i])) for r in rows]))
              for i, (h, cap) in enumerate(zip(headers, caps))]
    out = _wrap(title, width) + _rows_of(headers, widths) + ["  ".join("-" * w for w in widths)]
    indent = "    "
    for row in rows:
        out.extend(_rows_of([_cell(c) for c in row[:4]], widths))
        lines = textwrap.wrap(_cell(row[4]), width - len(indent), break_on_hyphens=False)
        if max_reason_lines is not None and len(lines) > max_reason_lines:
            lines = lines[:max(1, max_reason_lines)]
            last, room = lines[-1], width - len(indent) - 4
            while len(last) > room and " " in last:
                last = last.rsplit(" ", 1)[0]
            lines[-1] = last[:room] + " ..."

        out.extend(indent + line for line in lines)
    return "\n".join(out)


def plan_table(report: dict, width: int = 80, max_reason_lines: int | None = None, verified: bool = True) -> str:
    """The plan table of a report dict (``Report.to_dict()`` or a loaded ``speedup_report.json``)."""
    env = report.get("environment") or {}
    caps = report.get("capabilities") or {}
    device = env.get("device_name") or caps.get("device_name") or "?"
    dtype = env.get("device") or caps.get("device") or env.get("device_type") or caps.get("device_type") or "?"
    title = f"hf_speedup plan: preset '{report.get('preset')}' on {device} ({dtype})"
    return plan_table_rows(title, plan_rows(report.get("plan") or {}, verified), width, max_reason_lines)


# --------------------------------------------------------------------------------------- metrics
def fmt_bytes(n) -> str:
    return "-" if n is None else binary_bytes(n)


def fmt_num(v, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:,.{digits}f}"


def fmt_seconds(v) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.2f} s"


def fmt_pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def fmt_flops(v) -> str:
    """FLOP/s with an SI prefix: ``1.23 TFLOP/s``, ``85.0 GFLOP/s``."""
    if v is None:
        return "-"
    for unit, div in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if abs(v) >= div:
            return f"{v / div:,.{1 if abs(v) >= 10 * div else 2}f} {unit}FLOP/s"
    return f"{v:,.0f} FLOP/s"


def fmt_params(n) -> str:
    if n is None:
        return "-"
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def metric_rows(report: dict) -> list[list[str]]:
    """[label, value, note] rows of the metrics section, with how each was obtained."""
    m = report.get("metrics") or {}
    x = report.get("measurement") or {}
    mem_note = x.get("memory_source") or ""
    measures = x.get("memory_measures") or {}  # what each memory number is (older reports: none)
    steps = x.get("steps")
    steady = x.get("steady_state_steps")
    mfu_note = (f"of {x['peak_flops_per_device'] / 1e12:,.1f} TFLOP/s {x.get('compute_dtype', '')} "
                f"x {x.get('num_devices', 1)} ({x.get('peak_flops_source')})" if x.get("peak_flops_per_device")
                else (x.get("peak_flops_source") or "peak FLOP/s unknown"))
    whole = m.get("whole_run_seconds")
    rows = [
        ["tokens/s steady", fmt_num(m.get("tokens_per_second")),
         "non-padding tokens, all ranks; steady state: median step, compiling steps left out"],
        ["tokens/s whole run", fmt_num(m.get("whole_run_tokens_per_second")),
         f"wall clock over {fmt_seconds(whole)}, compiles and recompiles included" if whole else
         "wall clock, compiles and recompiles included"],
        ["samples/s steady", fmt_num(m.get("samples_per_second"), 2), ""],
        ["samples/s whole", fmt_num(m.get("whole_run_samples_per_second"), 2), ""],
        *goodput_rows(m, x),
        ["step time", fmt_seconds(m.get("step_time_s")),
         f"median of {steady} steady steps of {steps}" if steps else "steady state"],
        ["MFU", fmt_pct(m.get("mfu")), mfu_note],
        ["model FLOP/s", fmt_flops(m.get("model_flops_per_second")),
         f"FLOPs per token x steady tokens/s; whole run {fmt_flops(m.get('whole_run_model_flops_per_second'))}"],
        ["matmul peak", fmt_flops(m.get("matmul_peak_flops_per_second")), x.get("matmul_peak_source") or ""],
        ["of matmul peak", fmt_pct(m.get("fraction_of_matmul_peak")),
         f"model FLOP/s / (matmul peak x {x.get('num_devices', 1)})"],
        ["peak mem allocated", fmt_bytes(m.get("peak_memory_allocated_bytes")),
         measures.get("peak_memory_allocated_bytes", mem_note)],
        ["peak mem reserved", fmt_bytes(m.get("peak_memory_reserved_bytes")),
         measures.get("peak_memory_reserved_bytes", mem_note)],
        ["peak live tensors", fmt_bytes(x.get("peak_live_tensor_bytes")), measures.get("peak_live_tensor_bytes", "")],
        ["estimated peak", fmt_bytes(m.get("estimated_peak_bytes")), measures.get("estimated_peak_bytes", "")],
        ["expected per token", fmt_bytes((x.get("memory_estimate") or {}).get("bytes_per_token")),
         measures.get("estimated_bytes_per_token", "")],
        ["compile time", fmt_seconds(m.get("compile_seconds")), "dynamo + backend, this run"],
        ["recompile time", fmt_seconds(m.get("recompile_seconds")), "of it, after the first step"],
        ["recompiles", fmt_num(m.get("recompiles")), ""],
        ["graph breaks", fmt_num(m.get("graph_breaks")), ""],
        ["compiled regions", fmt_num(m.get("compiled_regions")), "modules running compiled"],
        ["trainable params", fmt_params(m.get("trainable_parameters")),
         fmt_num(m.get("trainable_parameters"))],
        ["total params", fmt_params(m.get("total_parameters")), fmt_num(m.get("total_parameters"))],
    ]
    split = ((report.get("profile") or {}).get("time_breakdown") or {})
    if split.get("steps"):  # a profile window ran: where its step's time went
        first, last = (report.get("profile") or {}).get("steps") or ["?", "?"]
        rows.append(["profiled step", fmt_seconds(split["step_ms"] / 1e3),
                     f"steps {first}-{last} under the profiler (slower than the run's); by bucket:"])
        for bucket, ms in sorted(split["buckets_ms"].items(), key=lambda kv: -kv[1]):
            if ms > 0:
                rows.append([f"  {bucket}", f"{split['buckets_percent'][bucket]:.1f}%", fmt_seconds(ms / 1e3)])
    return rows


def goodput_rows(m: dict, x: dict) -> list[list[str]]:
    """The goodput line and the wall clock's parts (none in reports older than them)."""
    if m.get("goodput") is None:
        return []
    split = x.get("time_split") or {}
    runs, covered = x.get("train_runs") or 1, split.get("runs_covered") or 1
    how = "productive step time / wall clock from process start"
    if runs > 1:
        how += (f" (all {runs} train() runs" if covered == runs else " (this process only") + \
            f"; this process {fmt_pct(split.get('goodput_this_process'))})"
    parts = (("set-up", "setup_seconds"), ("compile", "compile_seconds"), ("steps", "productive_step_seconds"),
             ("saves", "save_blocked_seconds"), ("eval", "eval_seconds"), ("data", "data_wait_seconds"),
             ("other", "other_seconds"))
    run = split.get("run") or {}
    seconds = {"compile_seconds": run.get("compile", m.get("compile_seconds"))}  # the split's own compile part
    return [["goodput", fmt_pct(m.get("goodput")), how],
            ["run wall clock", fmt_seconds(m.get("wall_clock_seconds")),
             ", ".join(f"{label} {fmt_seconds(seconds.get(key, m.get(key)))}" for label, key in parts)]]


def metrics_table(report: dict, width: int = 80) -> str:
    """The measured metrics of a report dict, three columns, within ``width``."""
    env = report.get("environment") or {}
    x = report.get("measurement") or {}
    rows = metric_rows(report)
    headers = ["metric", "value", "how"]
    widths = _fit(headers, rows, [18, 14], width)
    title = (f"hf_speedup metrics: preset '{report.get('preset')}', {x.get('steps', 0)} steps, "
             f"{x.get('num_devices', env.get('world_size', 1))} device(s), {env.get('device_name', '?')}")
    return "\n".join(_wrap(title, width)) + "\n" + table(headers, rows, widths)


# --------------------------------------------------------------------------------------- compare
def compare_table(reports: list[dict], labels: list[str], width: int = 80) -> str:
    """Runs side by side: per feature what engaged (and as what), then what each run achieved.

    Columns that do not fit in ``width`` continue in a further block below.
    """
    label_w = 18
    per_block = max(1, (width - label_w) // 14)
    blocks = []
    for start in range(0, len(reports), per_block):
        chunk = reports[start:start + per_block]
        names = labels[start:start + per_block]
        col_w = max(10, min(24, (width - label_w) // len(chunk) - 2))
        widths = [label_w] + [col_w] * len(chunk)
        base = reports[0]
        features: list[str] = []
        for r in reports:
            for f in (r.get("plan") or {}):
                if f not in features:
                    features.append(f)
        rows: list[list[str]] = [["engaged:"] + [""] * len(chunk)]
        for f in features:
            cells = []
            for r in chunk:
                d = (r.get("plan") or {}).get(f)
                if d is None:
                    cells.append("-")
                    continue
                applied = _cell(d.get("applied"))
                cells.append(("yes " + applied) if d.get("engaged") else f"no ({applied})")
            rows.append(["  " + f] + cells)
        rows.append(["achieved:"] + [""] * len(chunk))
        base_m = base.get("metrics") or {}
        for label, key, fmt in (("tokens/s steady", "tokens_per_second", fmt_num),
                                ("tokens/s whole", "whole_run_tokens_per_second", fmt_num),
                                ("samples/s", "samples_per_second", lambda v: fmt_num(v, 2)),
                                ("step time", "step_time_s", fmt_seconds), ("MFU", "mfu", fmt_pct),
                                ("model FLOP/s", "model_flops_per_second", fmt_flops),
                                ("of matmul peak", "fraction_of_matmul_peak", fmt_pct),
                                ("peak allocated", "peak_memory_allocated_bytes", fmt_bytes),
                                ("peak reserved", "peak_memory_reserved_bytes", fmt_bytes),
                                ("goodput", "goodput", fmt_pct),
                                ("saves blocked", "save_blocked_seconds", fmt_seconds),
                                ("compile time", "compile_seconds", fmt_seconds),
                                ("recompile time", "recompile_seconds", fmt_seconds),
                                ("recompiles", "recompiles", fmt_num), ("graph breaks", "graph_breaks", fmt_num),
                                ("compiled regions", "compiled_regions", fmt_num),
                                ("trainable params", "trainable_parameters", fmt_params)):
            rows.append(["  " + label] + [fmt((r.get("metrics") or {}).get(key)) for r in chunk])
        speed = []
        for r in chunk:
            a, b = (r.get("metrics") or {}).get("tokens_per_second"), base_m.get("tokens_per_second")
            speed.append(f"x{a / b:.2f}" if a and b else "-")
        rows.append(["  speed vs first"] + speed)
        whole = []
        for r in chunk:
            a, b = (r.get("metrics") or {}).get("whole_run_tokens_per_second"), \
                base_m.get("whole_run_tokens_per_second")
            whole.append(f"x{a / b:.2f}" if a and b else "-")
        rows.append(["  whole vs first"] + whole)
        mem = []
        for r in chunk:
            key = "peak_memory_allocated_bytes"
            a, b = (r.get("metrics") or {}).get(key), base_m.get(key)
            mem.append(f"x{a / b:.2f}" if a and b else "-")
        rows.append(["  memory vs first"] + mem)
        lines = _rows_of(["run"] + names, widths) + ["  ".join("-" * w for w in widths)]
        for row in rows:
            lines.extend(_rows_of([str(c) for c in row], widths))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)
