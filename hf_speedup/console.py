"""Plain-text tables that fit an 80-column terminal."""

from __future__ import annotations

import textwrap


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def table(headers: list[str], rows: list[list], widths: list[int]) -> str:
    """Fixed-width table; the last column wraps so lines stay within sum(widths)."""
    out = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    out.append("  ".join("-" * w for w in widths))
    for row in rows:
        cells = [_cell(c) for c in row]
        head = [c[:w].ljust(w) for c, w in zip(cells[:-1], widths[:-1])]
        wrapped = textwrap.wrap(cells[-1], widths[-1]) or [""]
        out.append(("  ".join(head) + "  " + wrapped[0]).rstrip())
        pad = " " * (sum(w + 2 for w in widths[:-1]))
        out.extend((pad + line).rstrip() for line in wrapped[1:])
    return "\n".join(out)


def plan_table(plan, width: int = 80) -> str:
    widths = [13, 12, 16, 7]
    widths.append(max(20, width - sum(w + 2 for w in widths)))
    rows = []
    for d in plan:
        dd = d.to_dict()
        engaged = "?" if d.engaged is None else ("yes" if d.engaged else "no")
        rows.append([d.feature, dd["requested"], dd["applied"], engaged, dd["reason"]])
    title = f"hf_speedup plan: preset '{plan.config.name}' on {plan.caps.device_name} ({plan.caps.device_type})"
    return title[:width] + "\n" + table(["feature", "requested", "applied", "engaged", "reason"], rows, widths)
