"""The code blocks of the docs as tests: collect fenced blocks from markdown, run or check them.

Conventions (CONTRIBUTING.md, "Code blocks in the docs are tests"):

- ```python blocks of one page run in order in one namespace (like a notebook), in a fresh process per page,
  cwd a temporary folder, ``WANDB_MODE=offline`` and ``HF_HUB_OFFLINE=1``;
- a block whose fence is directly preceded by ``<!-- docs: needs gpu -->`` (or ``needs multi-node``,
  ``needs network``) is not run: it is parsed, every import must resolve (the module is found, the imported
  names exist on it) and every ``hf_speedup.X`` attribute it uses must exist;
- in ```bash / ```sh / ```console blocks each line starting with ``hf-speedup `` (after an optional ``$ ``) is
  parsed by the CLI's own parser (an unknown flag or a bad value fails) and run, with ``--help`` appended
  unless it has ``--tiny`` (in a marked block: always with ``--help``); other lines are not run;
- launch lines (``accelerate launch``, ``torchrun``, ``deepspeed``, ``sbatch``, ``python examples/finetune.py``)
  and ``yaml`` blocks, marked or not, are checked without running (tests/doc_launchers.py).

``python tests/doc_blocks.py PAGE.md [checks|tiny]`` runs one page (what ``run_page`` starts: ``checks`` is all
but the real ``--tiny`` runs, ``tiny`` only those) and exits 1 when a block fails.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: its neighbour below
from doc_launchers import check_launch, check_yaml, launch_lines, shell_lines  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MARKERS = ("gpu", "multi-node", "network")
PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell", "console"}
PAGE_TIMEOUT_S = float(os.environ.get("HF_SPEEDUP_DOCS_TIMEOUT", 300))  # one page's checks, together
TINY_RUN_TIMEOUT_S = 600  # per hf-speedup line that runs for real (--tiny)
SHELL_STOP = {"|", "||", "&&", ";", ">", ">>", "2>", "&"}

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`\s]*)")
_MARKER = re.compile(r"^\s*<!--\s*docs:\s*(?P<what>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str  # "python", "shell" or the info string as written
    source: str
    marker: str | None  # "gpu", "multi-node", "network" or None

    @property
    def where(self) -> str:
        return f"{_rel(self.page)}:{self.line}"


class MarkerError(ValueError):
    """A ``<!-- docs: ... -->`` comment that is not one of the known markers (a typo would run the block)."""


def _rel(page: Path) -> str:
    try:
        return page.resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return str(page)


def _lang(info: str) -> str:
    info = info.lower().lstrip("{.").rstrip("}")
    return "python" if info in PYTHON else "shell" if info in SHELL else info


def collect(page: Path) -> list[Block]:
    """Every fenced block of a markdown page, in order; raises MarkerError on an unknown ``docs:`` marker."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m["indent"]), m["fence"]
        end = i + 1
        while end < len(lines) and not (lines[end].strip().startswith(fence[0] * len(fence))
                                        and lines[end].strip().strip(fence[0]) == ""):
            end += 1
        # a fence indented inside a list item: its lines lose that indent (and no more)
        body = [ln[min(indent, len(ln) - len(ln.lstrip())):] for ln in lines[i + 1:end]]
        marker = None
        if i > 0 and (mk := _MARKER.match(lines[i - 1])):
            what = mk["what"]
            if not what.startswith("needs ") or what[len("needs "):] not in MARKERS:
                raise MarkerError(f"{_rel(page)}:{i}: unknown marker <!-- docs: {what} -->; known: "
                                  + ", ".join(f"'needs {m}'" for m in MARKERS))
            marker = what[len("needs "):]
        blocks.append(Block(page, i + 1, _lang(m["info"]), "\n".join(body) + "\n", marker))
        i = end + 1
    return blocks


# ------------------------------------------------------------------------------------------- shell lines
def hf_speedup_commands(block: Block) -> list[tuple[int, list[str]]]:
    """(page line, argv after ``hf-speedup``) of each ``hf-speedup`` line; continuations joined, comments dropped."""
    out = []
    for start, text in shell_lines(block.source):
        if not text.startswith("hf-speedup "):
            continue
        argv = []
        for token in shlex.split(text, comments=True)[1:]:
            if token in SHELL_STOP:
                break
            argv.append(token)
        out.append((block.line + 1 + start, argv))
    return out


def runs_for_real(argv: list[str], block: Block) -> bool:
    return "--tiny" in argv and block.marker is None


def _cli_argv(argv: list[str], real: bool) -> list[str]:
    return argv if real or {"-h", "--help"} & set(argv) else [*argv, "--help"]


def check_parses(argv: list[str]) -> str | None:
    """The CLI's own parser on the line (nothing runs): an unknown flag, a bad choice or type is the problem."""
    import contextlib
    import io

    from hf_speedup.cli import build_parser

    if {"-h", "--help"} & set(argv):
        return None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            build_parser().parse_args(argv)
    except SystemExit as exc:
        return f"hf-speedup {shlex.join(argv)}: the CLI's parser refuses it (exit {exc.code}): {err.getvalue().strip()}"
    return None


def run_help(argv: list[str]) -> str | None:
    """``hf-speedup ARGV --help`` in this process (the page's own, so hf_speedup is imported once per page)."""
    import contextlib
    import io

    from hf_speedup.cli import main

    argv, out = _cli_argv(argv, False), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = main(argv)
    except SystemExit as exc:
        code = exc.code
    if code not in (0, None) or "usage: hf-speedup" not in out.getvalue():
        return f"hf-speedup {shlex.join(argv)}: exit status {code}\n{out.getvalue()[-3000:]}"
    return None


def run_command(argv: list[str], real: bool, cwd: str, timeout: float) -> str | None:
    """``hf-speedup ARGV`` in its own process (``--help`` appended unless ``real``); what went wrong, else None."""
    argv = _cli_argv(argv, real)
    cmd = [sys.executable, "-c", "import sys; from hf_speedup.cli import main; sys.exit(main(sys.argv[1:]))", *argv]
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"hf-speedup {shlex.join(argv)}: still running after {timeout:.0f} s"
    if out.returncode != 0:
        return f"hf-speedup {shlex.join(argv)}: exit status {out.returncode}\n{(out.stdout + out.stderr)[-3000:]}"
    return None


# ------------------------------------------------------------------------------------------- marked blocks
def _resolve(module: str, attrs: list[str]) -> str | None:
    """Import ``module`` and walk ``attrs`` (importing submodules on the way); the first missing name, else None."""
    obj, path = importlib.import_module(module), module
    for attr in attrs:
        if not hasattr(obj, attr):
            try:
                if importlib.util.find_spec(f"{path}.{attr}") is None:
                    return f"{path}.{attr}"
                importlib.import_module(f"{path}.{attr}")
            except ImportError:
                return f"{path}.{attr}"
        obj, path = getattr(obj, attr), f"{path}.{attr}"
    return None


def _find(module: str) -> str | None:
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError) as exc:
        return f"module {module!r} cannot be found ({type(exc).__name__}: {exc})"
    return None if found else f"module {module!r} is not installed"


def _attr_chain(node: ast.AST) -> tuple[str, list[str]] | None:
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) and attrs else None


def check_static(block: Block) -> list[str]:
    """What a block that is not run must still get right: syntax, its imports, the hf_speedup names it uses."""
    try:
        tree = ast.parse("\n" * block.line + block.source, filename=str(block.page))
    except SyntaxError as exc:
        return [f"line {exc.lineno}: syntax error: {exc.msg}"]
    problems, modules = [], {}  # local name -> hf_speedup module path it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (why := _find(alias.name)) is not None:
                    problems.append(f"line {node.lineno}: import {alias.name}: {why}")
                elif alias.name.split(".")[0] == "hf_speedup":
                    modules[alias.asname or "hf_speedup"] = alias.name if alias.asname else "hf_speedup"
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                problems.append(f"line {node.lineno}: relative import in a docs example")
                continue
            if (why := _find(node.module)) is not None:
                problems.append(f"line {node.lineno}: from {node.module} import ...: {why}")
                continue
            for alias in node.names:
                if alias.name == "*":
                    continue
                try:
                    missing = _resolve(node.module, [alias.name])
                except Exception as exc:  # noqa: BLE001 - an import that raises is the finding
                    problems.append(f"line {node.lineno}: importing {node.module} raised {type(exc).__name__}: {exc}")
                    break
                if missing:
                    problems.append(f"line {node.lineno}: from {node.module} import {alias.name}: "
                                    f"{node.module} has no {alias.name!r}")
                elif node.module.split(".")[0] == "hf_speedup" and importlib.util.find_spec(
                        f"{node.module}.{alias.name}") is not None:
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        chain = _attr_chain(node) if isinstance(node, ast.Attribute) else None
        if chain and chain[0] in modules and not isinstance(getattr(node, "ctx", None), ast.Store):
            try:
                missing = _resolve(modules[chain[0]], chain[1])
            except Exception as exc:  # noqa: BLE001
                missing = f"{modules[chain[0]]} ({type(exc).__name__}: {exc})"
            if missing:
                problems.append(f"line {node.lineno}: {'.'.join([chain[0], *chain[1]])}: no {missing}")
    return sorted(set(problems), key=lambda p: int(p.split(":")[0].split()[1]))


# ------------------------------------------------------------------------------------------- one page
def tiny_runs(blocks: list[Block]) -> int:
    """How many ``hf-speedup ... --tiny`` lines of these blocks run for real."""
    return sum(runs_for_real(argv, b) for b in blocks if b.lang == "shell" for _, argv in hf_speedup_commands(b))


def page_timeout(blocks: list[Block], mode: str = "checks") -> float:
    return PAGE_TIMEOUT_S if mode == "checks" else TINY_RUN_TIMEOUT_S * max(1, tiny_runs(blocks))


def run_blocks(page: Path, mode: str = "checks") -> int:
    """In this (fresh) process, the page's blocks in order; prints each finding, returns 1 when any failed.

    ``checks``: the python blocks, and every ``hf-speedup`` line parsed and run with ``--help`` (``--tiny`` ones
    too); ``tiny``: only the ``hf-speedup ... --tiny`` lines, run for real (minutes each)."""
    blocks, failed, namespace = collect(page), 0, {"__name__": "__main__"}
    python_broken = False

    def fail(block: Block, line: int | None, text: str) -> None:
        nonlocal failed
        failed += 1
        at = f"{_rel(block.page)}:{line}" if line else block.where
        print(f"FAILED {at} ({block.lang} block at line {block.line}"
              + (f", needs {block.marker}" if block.marker else "") + f"):\n{text}\n", flush=True)

    for block in blocks:
        if mode == "tiny":
            for line, argv in hf_speedup_commands(block) if block.lang == "shell" else []:
                if runs_for_real(argv, block) and (problem := run_command(argv, True, os.getcwd(),
                                                                          TINY_RUN_TIMEOUT_S)):
                    fail(block, line, problem)
        elif block.lang == "python" and block.marker:
            for problem in check_static(block):
                fail(block, None, problem)
        elif block.lang == "python":
            if python_broken:
                print(f"SKIPPED {block.where}: an earlier python block of this page failed", flush=True)
                continue
            try:
                code = compile("\n" * block.line + block.source, str(block.page.resolve()), "exec")
                exec(code, namespace)  # noqa: S102 - running the docs' examples is the point
            except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt from a block are findings
                python_broken = True  # the traceback from the page's frame on (this runner's frame left out)
                fail(block, None, "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next)))
        elif block.lang == "shell":
            for line, argv in hf_speedup_commands(block):
                problem = check_parses(argv) or run_help(argv)
                if problem:
                    fail(block, line, problem)
            for line, tokens, unsplit in launch_lines(block.source, block.line):
                for problem in [unsplit] if unsplit else check_launch(tokens):
                    fail(block, line, problem)
        elif block.lang == "yaml":
            for problem in check_yaml(block.source):
                fail(block, None, problem)
    print(f"{_rel(page)} ({mode}): {len(blocks)} blocks, {failed} failed", flush=True)
    return 1 if failed else 0


def page_env() -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", "MPLBACKEND": "Agg", "PYTHONPATH": path}


def run_page(page: Path, mode: str = "checks", timeout: float | None = None) -> subprocess.CompletedProcess:
    """``run_blocks`` in a fresh process, cwd a temporary folder; a timeout is a failed run (returncode -9)."""
    timeout = timeout or page_timeout(collect(page), mode)
    with tempfile.TemporaryDirectory(prefix="doc_blocks_") as cwd:
        cmd = [sys.executable, str(Path(__file__).resolve()), str(page.resolve()), mode]
        try:
            return subprocess.run(cmd, cwd=cwd, env=page_env(), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            return subprocess.CompletedProcess(cmd, -9, out + f"\n{_rel(page)}: timed out after {timeout:.0f} s", "")


def doc_pages(root: Path = ROOT) -> list[Path]:
    pages = [root / name for name in ("README.md", "CONTRIBUTING.md") if (root / name).exists()]
    return pages + sorted((root / "docs").rglob("*.md")) if (root / "docs").is_dir() else pages


if __name__ == "__main__":
    target = Path(sys.argv[1]).resolve()
    if Path.cwd().resolve() == ROOT:  # by hand from the checkout: the page's files go to a temporary folder
        os.chdir(tempfile.mkdtemp(prefix="doc_blocks_"))
    sys.exit(run_blocks(target, *sys.argv[2:3]))
