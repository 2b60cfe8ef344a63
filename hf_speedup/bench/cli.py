"""The ``hf-speedup bench`` command line (also ``python -m hf_speedup.bench``)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys

from .options import (DEFAULT_PEERS, DEFAULT_PRESETS, PEERS, PROFILES, BenchOptions, dry_run, parse_model_config,
                      split_list, variant_kind)

DESCRIPTION = """Every preset against the peers, on your model and hardware: one table of non-padding tokens/s
and its ratio to the stock Trainer, step time, peak memory, MFU, cold start and the loss reached.
Each variant is a fresh process; on CPU they run in lock step (step i of each, back to back)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", help="hub id or local path of a causal LM (a folder, or a .gguf file: dequantized "
                                   "to fp32 in every worker; benchmarks/smollm2_dir.py saves one as a folder once)")
    g.add_argument("--tiny", action="store_true", help="the embedded tiny Llama (default when no model is given)")
    g.add_argument("--config", metavar="JSON", help="build a model from this config (inline JSON or a file; "
                                                    "random weights, no hub), e.g. '{\"model_type\": \"llama\", ...}'")
    p.add_argument("--presets", help=f"comma list of presets, PRESET:section.field=value edits or .yaml configs "
                                     f"(default {','.join(DEFAULT_PRESETS)})")
    p.add_argument("--peers", help=f"comma list of {', '.join(PEERS)} (default {','.join(DEFAULT_PEERS)}); "
                                   "stock always runs: ratios are taken against it")
    p.add_argument("--batch-size", type=int, help="rows per step (default 8)")
    p.add_argument("--seq-len", type=int, help="longest row; ragged rows are 16..min(512, seq-len) tokens (default 512)")
    p.add_argument("--data", help="ragged (default: lengths log-uniform 16-512, the tiny task's text), fixed (every "
                                  "row seq-len real tokens), docs-chat (real text: single-turn chats built offline "
                                  "from this Python's standard library documentation, in the model's chat template, "
                                  "40-1024 tokens, median ~350 with SmolLM2's tokenizer; use --seq-len 1024; "
                                  "python -m hf_speedup.bench.chat_data prints its lengths) or a .jsonl/.json/.txt FILE")
    p.add_argument("--steps", type=int, help="optimizer steps per variant (default 20)")
    p.add_argument("--warmup", type=int, help="steps left out of the steady state (default min(5, steps // 4))")
    p.add_argument("--output", help="folder for bench.json, bench.md, bench.png and the logs (default outputs/bench)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--schedule", choices=("auto", "lockstep", "sequential"),
                   help="lockstep (CPU default) or one variant after another (GPU default)")
    p.add_argument("--precision", choices=("auto", "fp32", "bf16"),
                   help="TrainingArguments for every variant: bf16=True or fp32 (auto: bf16 on CUDA)")
    p.add_argument("--learning-rate", type=float)
    p.add_argument("--threads", type=int, help="torch threads in every worker (default: torch's choice)")
    p.add_argument("--timeout", type=float, help="seconds a worker may take to set up, for one step, or to wrap up")
    p.add_argument("--profile", help=f"named settings ({', '.join(PROFILES)}); the flags above override them")
    p.add_argument("--breakdown", action="store_true",
                   help="profile one extra step per variant (after the timed ones) and show where its time goes: "
                        "matmul, attention, loss, optimizer, data, compiled, elementwise, overhead")
    p.add_argument("--dry-run", action="store_true", help="the same plan on CPU with a tiny config (proves it)")


FIELDS = ("model", "batch_size", "seq_len", "data", "steps", "warmup", "output", "device", "schedule",
          "precision", "learning_rate", "threads", "timeout")


def as_argv(ns: argparse.Namespace) -> list[str]:
    """The flags that were given, back as a command line (for the record)."""
    out: list[str] = []
    for key in ("model", "config", "profile", "presets", "peers", *FIELDS[1:]):
        value = getattr(ns, key, None)
        if value is not None:
            out += [f"--{key.replace('_', '-')}", str(value)]
    out += [f"--{flag.replace('_', '-')}" for flag in ("tiny", "breakdown", "dry_run") if getattr(ns, flag, False)]
    return out


def options_from_args(ns: argparse.Namespace, argv: list[str] | None = None) -> BenchOptions:
    """Defaults, then the profile's settings, then the flags given."""
    settings: dict = {}
    if ns.profile is not None:
        settings.update(PROFILES.get(ns.profile, {}))
        settings["profile"] = ns.profile
    profile_variants = settings.pop("variants", None)
    settings.update({f: getattr(ns, f) for f in FIELDS if getattr(ns, f) is not None})
    if ns.tiny:
        settings.update(tiny=True, model_config=None)
    if getattr(ns, "breakdown", False):
        settings["breakdown"] = True
    if ns.config is not None:
        settings["model_config"] = parse_model_config(ns.config)
    peers = split_list(ns.peers) if ns.peers is not None else None
    presets = split_list(ns.presets) if ns.presets is not None else None
    if profile_variants is not None and peers is None and presets is None:
        settings["variants"] = list(profile_variants)  # the profile's own order
    else:
        if profile_variants is not None:
            peers = peers if peers is not None else [v for v in profile_variants if variant_kind(v) == "peer"]
            presets = presets if presets is not None else [v for v in profile_variants if variant_kind(v) != "peer"]
        settings["variants"] = [*(peers if peers is not None else DEFAULT_PEERS),
                                *(presets if presets is not None else DEFAULT_PRESETS)]
    settings["command"] = "hf-speedup bench " + shlex.join(argv if argv is not None else as_argv(ns))
    options = BenchOptions(**{k: v for k, v in settings.items() if k in {f.name for f in dataclasses.fields(BenchOptions)}})
    return dry_run(options) if ns.dry_run else options


def run_from_args(ns: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run, print the table; exit status 1 when a variant failed (not-run peers are not failures)."""
    from .core import run_bench

    result = run_bench(options_from_args(ns, argv))
    print()
    print(result.text(), flush=True)
    return 1 if any(v["status"] == "failed" for v in result.variants) else 0


def main(argv: list[str] | None = None) -> int:
    from ..config import SpeedupConfigError

    p = argparse.ArgumentParser(prog="hf-speedup bench", description=DESCRIPTION)
    add_arguments(p)
    args = list(sys.argv[1:] if argv is None else argv)
    ns = p.parse_args(args)
    try:
        return run_from_args(ns, args)
    except SpeedupConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
