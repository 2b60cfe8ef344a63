"""MkDocs hook: the site's results page is benchmarks/RESULTS.md without its lab notes.

RESULTS.md is the project's record: beside the measurements it keeps what only the people building the package
read (which targets an issue set were met, how device time was budgeted, structure metrics). Those passages are
marked there, and the page a user reads leaves them out:

- ``<!-- lab -->`` on its own line: the paragraph that follows it (up to the next blank line) is a lab note;
- ``<!-- lab:start -->`` ... ``<!-- lab:end -->``: everything between is.

A page line ``<!-- results-without-lab-notes -->`` becomes that text.
"""

from __future__ import annotations

from pathlib import Path

MARKER = "<!-- results-without-lab-notes -->"
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "RESULTS.md"


def without_lab_notes(text: str) -> str:
    out: list[str] = []
    skip = in_block = in_fence = False  # skip: inside a marked paragraph (a code fence in it is skipped whole)
    for number, line in enumerate(text.split("\n"), 1):
        mark = line.strip()
        if mark in ("<!-- lab -->", "<!-- lab:start -->", "<!-- lab:end -->") and (skip or in_fence):
            raise ValueError(f"RESULTS.md:{number}: {mark} inside a lab note")
        if mark == "<!-- lab:start -->":
            if in_block:
                raise ValueError(f"RESULTS.md:{number}: <!-- lab:start --> inside a lab block")
            in_block = True
        elif mark == "<!-- lab:end -->":
            if not in_block:
                raise ValueError(f"RESULTS.md:{number}: <!-- lab:end --> without <!-- lab:start -->")
            in_block = False
        elif mark == "<!-- lab -->":
            skip = "start"
        elif skip:
            if skip == "start" and not mark:
                raise ValueError(f"RESULTS.md:{number}: <!-- lab --> must stand right before its paragraph")
            skip = True
            if mark.startswith("```"):
                in_fence = not in_fence
            elif not mark and not in_fence:
                skip = False
                out.append(line)  # the blank line that ends the paragraph stays
        elif not in_block:
            out.append(line)
    if in_block:
        raise ValueError("RESULTS.md: <!-- lab:start --> without <!-- lab:end -->")
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, without_lab_notes(RESULTS.read_text(encoding="utf-8")))
    return markdown
