"""MkDocs hook: the CLI reference page is built from ``hf_speedup.cli.build_parser()`` at build time, so every
``hf-speedup <command> --help`` in the docs is the installed one (no copy to go stale).

A page line ``<!-- cli-help -->`` is replaced by one section per sub-command with its ``--help`` text.
"""

from __future__ import annotations

import argparse
import os

MARKER = "<!-- cli-help -->"


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def cli_help_markdown() -> str:
    from hf_speedup.cli import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal width: fixed, so builds are reproducible
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


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, cli_help_markdown())
    return markdown
