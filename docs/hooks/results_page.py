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
    skip_paragraph = in_block = False
    for line in text.split("\n"):
        mark = line.strip()
        if mark == "<!-- lab:start -->":
            in_block = True
        elif mark == "<!-- lab:end -->":
            if not in_block:
                raise ValueError("RESULTS.md: <!-- lab:end --> without <!-- lab:start -->")
            in_block = False
        elif mark == "<!-- lab -->":
            skip_paragraph = True
        elif skip_paragraph:
            skip_paragraph = bool(mark)  # the paragraph ends at the first blank line, which is kept
            if not skip_paragraph:
                out.append(line)
        elif not in_block:
            out.append(line)
    if in_block:
        raise ValueError("RESULTS.md: <!-- lab:start --> without <!-- lab:end -->")
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        markdown = markdown.replace(MARKER, without_lab_notes(RESULTS.read_text(encoding="utf-8")))
    return markdown
