"""MkDocs hook: reference text generated from the code at build time, so it cannot go stale.

- A page line ``<!-- cli-help -->`` becomes one section per ``hf-speedup`` sub-command with its ``--help`` text
  (from ``hf_speedup.cli.build_parser()``).
- A page line ``<!-- config-fields -->`` becomes a table of every SpeedupConfig field: its default and the comment
  beside it in ``hf_speedup/config/sections.py`` (allowed values, meaning).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re

MARKER = "<!-- cli-help -->"
CONFIG_MARKER = "<!-- config-fields -->"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_help_markdown() -> str:
    from hf_speedup.cli import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "80"  # argparse wraps at the terminal width: fixed, so builds are reproducible
    try:
        parser = build_parser()
        parts = ["## `hf-speedup`", "", "```text", parser.format_help().rstrip(), "```", ""]
        for name, sub in _subparsers(parser).items():
            parts += [f"## `hf-speedup {name}`", "", "```text", sub.format_help().rstrip(), "```", ""]
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(parts)


def _field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment beside it, or the comment lines right above it."""
    comments, above = {}, []
    for line in inspect.getsource(cls).splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# "))
            continue
        m = re.match(r"\s+(\w+):[^#]*?(?:#\s*(.*))?$", line)
        if m and (m.group(2) or above):
            comments[m.group(1)] = (m.group(2) or " ".join(above)).strip()
        above = []
    return comments


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def config_fields_markdown() -> str:
    from hf_speedup.config import CHOICES
    from hf_speedup.config.sections import INTERRUPT_SIGNALS, SECTIONS

    extra = {"interrupt.signals": "any of " + ", ".join(INTERRUPT_SIGNALS)}

    rows = ["| field | default | allowed values / meaning |", "|---|---|---|"]
    for section, cls in SECTIONS.items():
        comments = _field_comments(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            shown = "null" if default is None else (str(default).lower() if isinstance(default, bool) else default)
            what = comments.get(f.name, "") or extra.get(f"{section}.{f.name}", "")
            if not what and f"{section}.{f.name}" in CHOICES:
                what = " | ".join("null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)
                                  for v in CHOICES[f"{section}.{f.name}"][0])
            rows.append(f"| `{section}.{f.name}` | `{_cell(str(shown))}` | {_cell(what)} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, cli_help_markdown())
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_fields_markdown())
    return markdown
