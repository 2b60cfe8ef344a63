"""The launch commands and config files of the docs, checked without launching (what tests/doc_blocks.py runs on
``bash`` blocks beside the ``hf-speedup`` lines, and on ``yaml`` blocks):

- each command of a line (split at ``&&``, ``||``, ``;``, ``|``, ``&``; redirections dropped) that is
  ``accelerate launch``, ``torchrun`` or ``deepspeed`` is parsed by the launcher's own parser (an unknown option
  fails; ``--help`` passes); ``sbatch [options] SCRIPT ARGS`` hands ARGS to torchrun (as
  ``examples/slurm/train.sbatch`` does), so they are parsed by torchrun's parser;
- every ``configs/``, ``examples/`` or ``tests/`` path the command names (``--flag=path`` too) exists in the
  repository;
- the arguments given to ``examples/finetune.py`` are parsed by its own parser, and its ``--speedup`` is a preset or
  a YAML file in the repository that loads as a SpeedupConfig;
- a ``yaml`` block with a ``base:`` key, or whose top-level keys are all SpeedupConfig sections, is a SpeedupConfig
  (or a part of one): it loads (unknown fields and bad values fail).

Placeholders: ``$NODE_RANK``-style variables are parsed as ``0`` (launchers take integers there), ``PATH_OR_ID`` as
it is; a ``--speedup`` YAML without a folder (``my-hsdp.yaml``) is the reader's own file, not looked up.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEPARATORS = {"|", "||", "&&", ";", "&"}
REDIRECTS = {">", ">>", "<", "&>", ">&"}
FINETUNE = "examples/finetune.py"
LAUNCHERS = ("accelerate", "torchrun", "deepspeed", "sbatch")


def _is_launch(tokens: list[str]) -> bool:
    return bool(tokens) and (tokens[:2] == ["accelerate", "launch"] or tokens[0] in LAUNCHERS[1:]
                             or (tokens[0].startswith("python") and len(tokens) > 1 and tokens[1] == FINETUNE))


def _commands(tokens: list[str]) -> list[list[str]]:
    out, current, skip = [], [], False
    for token in tokens:
        if skip:
            skip = False
        elif token in SEPARATORS:
            out.append(current)
            current = []
        elif token in REDIRECTS:
            skip = True  # its target
        else:
            current.append(token)
    out.append(current)
    for command in out:
        while command and "=" in command[0] and not command[0].startswith("-"):  # VAR=value before the command
            command.pop(0)
    return out


def shell_lines(source: str) -> list[tuple[int, str]]:
    """(offset of its first line in the block, text) of each line of a shell block: ``\\`` continuations joined, a
    leading ``$ `` prompt dropped."""
    out, lines, i = [], source.splitlines(), 0
    while i < len(lines):
        start, text = i, lines[i]
        while text.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text.rstrip()[:-1] + " " + lines[i].strip()
        i += 1
        out.append((start, text.strip().removeprefix("$ ").lstrip()))
    return out


def launch_lines(source: str, first_line: int) -> list[tuple[int, list[str], str | None]]:
    """(page line, tokens, problem) of each launch command of a shell block; continuations joined, comments dropped,
    ``$VARS`` as ``0``. A launch line the shell could not split (an open quote) comes back with its problem."""
    out = []
    for start, text in shell_lines(source):
        text = re.sub(r"\$\{?[A-Za-z_][A-Za-z0-9_]*\}?", "0", text)
        text = re.sub(r"(^|\s)\d*>&\d+", " ", text)  # 2>&1
        text = re.sub(r"(^|\s)\d+(?=>)", " ", text)  # 2> file: the descriptor is not an argument
        try:
            lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            tokens = list(lexer)
        except ValueError as exc:
            if text.split()[:1] and text.split()[0] in LAUNCHERS + ("python", "python3"):
                out.append((first_line + 1 + start, [], f"the shell cannot split this line ({exc}): {text}"))
            continue
        out += [(first_line + 1 + start, command, None) for command in _commands(tokens) if _is_launch(command)]
    return out


def _parse(parser: argparse.ArgumentParser, argv: list[str], what: str) -> tuple[argparse.Namespace | None, str]:
    """(namespace, "") where the parser takes ``argv``; (None, "") for ``--help`` (it exits 0); else the refusal."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(argv), ""
    except SystemExit as exc:
        if exc.code in (0, None):
            return None, ""
        return None, f"{what}: its parser refuses {shlex.join(argv)} (exit {exc.code}): {err.getvalue().strip()}"


def _launcher(tokens: list[str]) -> tuple[str | None, list[str], str]:
    """(training script, its arguments, problem) of one launch line."""
    if tokens[0] == "accelerate":
        from accelerate.commands.launch import launch_command_parser

        ns, why = _parse(launch_command_parser(), tokens[2:], "accelerate launch")
        return (ns.training_script, ns.training_script_args, "") if ns else (None, [], why)
    if tokens[0] == "torchrun":
        from torch.distributed.run import get_args_parser

        ns, why = _parse(get_args_parser(), tokens[1:], "torchrun")
        return (ns.training_script, ns.training_script_args, "") if ns else (None, [], why)
    if tokens[0] == "deepspeed":
        if importlib.util.find_spec("deepspeed") is None:
            return None, [], ""  # not installed here: the paths are still checked
        from deepspeed.launcher.runner import parse_args

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                ns = parse_args(tokens[1:])
        except SystemExit as exc:
            if exc.code in (0, None):
                return None, [], ""
            return None, [], f"deepspeed: its parser refuses {shlex.join(tokens[1:])} (exit {exc.code}): {err.getvalue()}"
        return ns.user_script, ns.user_args, ""
    if tokens[0] == "sbatch":
        rest = tokens[1:]
        script = next((i for i, t in enumerate(rest) if t.endswith((".sbatch", ".sh"))), None)
        if script is None:
            return None, [], "sbatch: no batch script (.sbatch or .sh) on the line"
        if not rest[script + 1:]:
            return None, [], ""  # the script's default command
        from torch.distributed.run import get_args_parser  # the script's "$@" goes to torchrun

        ns, why = _parse(get_args_parser(), ["--nnodes", "1", *rest[script + 1:]], "sbatch's torchrun")
        return (ns.training_script, ns.training_script_args, "") if ns else (None, [], why)
    return tokens[1], tokens[2:], ""  # python examples/finetune.py ...


def _finetune_parser():
    spec = importlib.util.spec_from_file_location("_docs_finetune", ROOT / FINETUNE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args


def check_speedup(value: str) -> str | None:
    """A preset name, or a YAML file in the repository that loads as a SpeedupConfig."""
    from hf_speedup.presets import list_presets, load_config

    if not value.endswith((".yaml", ".yml")):
        return None if value in list_presets() else f"--speedup {value}: no such preset ({', '.join(list_presets())})"
    if "/" not in value:
        return None  # the reader's own file, written beside the command
    path = ROOT / value
    if not path.is_file():
        return f"--speedup {value}: no such file in the repository"
    try:
        load_config(path)
    except Exception as exc:  # noqa: BLE001 - a config that does not load is the finding
        return f"--speedup {value}: does not load: {type(exc).__name__}: {exc}"
    return None


def check_launch(tokens: list[str]) -> list[str]:
    paths = [t.split("=", 1)[1] if t.startswith("-") and "=" in t else t for t in tokens]
    problems = [f"{t}: no such file in the repository" for t in paths
                if t.startswith(("configs/", "examples/", "tests/")) and not (ROOT / t).exists()]
    script, args, why = _launcher(tokens)
    if why:
        problems.append(why)
    if script == FINETUNE:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                ns = _finetune_parser()(args)
        except SystemExit as exc:
            if exc.code not in (0, None):  # --help exits 0
                problems.append(f"{FINETUNE}: its parser refuses {shlex.join(args)} (exit {exc.code}): "
                                f"{err.getvalue().strip()}")
        else:
            if (bad := check_speedup(ns.speedup)) is not None:
                problems.append(bad)
    return problems


def check_yaml(source: str) -> list[str]:
    """A ``yaml`` block with ``base:`` or made of SpeedupConfig sections loads as one; other YAML only parses."""
    import dataclasses

    import yaml

    from hf_speedup import SpeedupConfig
    from hf_speedup.presets import from_dict

    try:
        data = yaml.safe_load(source)
    except yaml.YAMLError as exc:
        return [f"not YAML: {exc}"]
    sections = {f.name for f in dataclasses.fields(SpeedupConfig)} | {"base"}
    if isinstance(data, dict) and data and ("base" in data or set(data) <= sections):
        try:
            from_dict(data, source="the docs")
        except Exception as exc:  # noqa: BLE001
            return [f"not a SpeedupConfig: {type(exc).__name__}: {exc}"]
    return []
