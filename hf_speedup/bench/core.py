"""``run_bench``: validate, run every variant in its own worker, summarise, write JSON + table + PNG."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .machine import describe, machine_info
from .options import REFERENCE, BenchOptions
from .plot import plot
from .results import all_finite, markdown_table, notes, summarize
from .runner import run_variants

RESULT_FILE = "bench.json"
TABLE_FILE = "bench.md"
PLOT_FILE = "bench.png"


@dataclass
class BenchResult:
    options: BenchOptions
    device: str
    schedule: str
    machine: dict
    variants: list[dict]
    notes: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)

    def table(self) -> str:
        return markdown_table(self.variants)

    def row(self, name: str) -> dict:
        return next(v for v in self.variants if v["name"] == name)

    def to_dict(self) -> dict:
        return {"bench_version": 1, "command": self.options.command, "machine": self.machine,
                "device": self.device, "schedule": self.schedule, "reference": REFERENCE,
                "options": self.options.to_dict(), "variants": self.variants, "notes": self.notes,
                "table": self.table(), "all_finite": all_finite(self.variants)}

    def text(self) -> str:
        """What the command prints: the machine, the table, then the notes."""
        lines = [f"machine: {describe(self.machine)}", "", self.table(), ""]
        lines += [f"- {n}" for n in self.notes]
        if self.files:
            lines += ["", "written: " + ", ".join(self.files.values())]
        return "\n".join(lines)


def prepare_data(options: BenchOptions, output: str) -> tuple[str | None, list[str]]:
    """Rows a builder makes from more than the tokenizer (``docs-chat``: the standard library's documentation)
    are made once here and written to ``<output>/data/``; every worker reads that file. (None, []) otherwise."""
    if options.data != "docs-chat":
        return None, []
    from .chat_data import describe as describe_rows
    from .data import make_rows
    from .variants import tokenizer_for

    rows = make_rows(tokenizer_for(options.to_dict()), "docs-chat", options.batch_size * (options.steps + 1),
                     options.seq_len, options.seed)
    path = os.path.join(output, "data", "docs-chat.jsonl")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        for row in rows:
            fh.write(json.dumps({"input_ids": row["input_ids"]}) + "\n")
    note = (f"data: docs-chat (Python's standard library documentation as single-turn chats, the model's chat "
            f"template; hf_speedup/bench/chat_data.py): {describe_rows(rows)}; every variant trains on every token.")
    return path, [note]


def run_bench(options: BenchOptions, say=print) -> BenchResult:
    """Every variant of ``options`` side by side on this machine; results under ``options.output``."""
    options.validate()  # every problem at once, before any process starts
    device = options.resolved_device()
    schedule = options.resolved_schedule(device)
    output = os.path.abspath(options.output)
    os.makedirs(output, exist_ok=True)
    info = machine_info(device)
    say(f"machine: {describe(info)}", flush=True)
    rows_file, data_notes = prepare_data(options, output)
    for note in data_notes:
        say(note, flush=True)
    rows = run_variants(options, device, output, say, rows_file=rows_file)
    entries = summarize(rows, options)
    result = BenchResult(options, device, schedule, info, entries, data_notes + notes(entries, options, device))
    result.files = {"json": os.path.join(output, RESULT_FILE), "table": os.path.join(output, TABLE_FILE)}
    why = plot(entries, os.path.join(output, PLOT_FILE), title=describe(info))
    if why:
        result.notes.append(why)
    else:
        result.files["png"] = os.path.join(output, PLOT_FILE)
    with open(result.files["table"], "w") as fh:
        fh.write((f"$ {options.command}\n\n" if options.command else "") + result.text() + "\n")
    with open(result.files["json"], "w") as fh:
        json.dump(result.to_dict(), fh, indent=1, default=str)
    return result
