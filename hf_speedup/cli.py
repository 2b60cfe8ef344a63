"""`hf-speedup` command: presets, plan, accelerate-config, report, demo."""

from __future__ import annotations

import argparse
import sys


def _cmd_presets(ns) -> int:
    from .report.console import table
    from .presets import list_presets, write_preset_yamls

    if ns.write:
        for p in write_preset_yamls(ns.write):
            print(p)
        return 0
    rows = [[name, desc] for name, desc in list_presets().items()]
    print(table(["preset", "what it turns on / trade-off"], rows, [12, 66]))
    return 0


def _load_model_for_plan(ns):
    """A model to plan for, built on the meta device when possible so no weights are read."""
    if ns.tiny or not ns.model:
        from .tiny import tiny_llama

        return tiny_llama()
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ns.model)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _cmd_plan(ns) -> int:
    from .plan import build_plan
    from .report import Report

    report = Report(build_plan(ns.preset if not ns.config else ns.config, model=_load_model_for_plan(ns)))
    if ns.json:
        import json

        print(json.dumps(report.to_dict()["plan"], indent=2))
    else:
        print(report.table())
    return 0


def _cmd_accelerate_config(ns) -> int:
    from .accelerate_config import write_accelerate_config

    out = write_accelerate_config(ns.preset, num_processes=ns.num_processes, num_machines=ns.num_machines,
                                  path=ns.output)
    print(out)
    return 0


def _cmd_report(ns) -> int:
    from .report import cli as report_cli

    if ns.compare:
        report_cli.compare_reports([ns.path, *ns.compare])
    else:
        report_cli.print_report(ns.path)
    if ns.plot:
        report_cli.plot_report(ns.path, ns.plot)
        print(f"plot written to {ns.plot}")
    return 0


def _cmd_demo(ns) -> int:
    from .demo import run_demo

    run_demo(ns.preset, max_steps=ns.max_steps, output_dir=ns.output_dir)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-speedup", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("presets", help="list the presets with what they turn on")
    s.add_argument("--write", metavar="DIR", help="write every preset as YAML into DIR")
    s.set_defaults(func=_cmd_presets)

    s = sub.add_parser("plan", help="print the plan (decisions and reasons) for this machine")
    s.add_argument("--preset", default="auto")
    s.add_argument("--config", help="a SpeedupConfig YAML (overrides --preset)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--model", help="hub id or local path (only its config is read)")
    g.add_argument("--tiny", action="store_true", help="plan for the embedded tiny Llama (default)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_cmd_plan)

    s = sub.add_parser("accelerate-config", help="write an accelerate YAML for a preset and a cluster shape")
    s.add_argument("--preset", default="fsdp")
    s.add_argument("--num-processes", type=int, required=True)
    s.add_argument("--num-machines", type=int, default=1)
    s.add_argument("--output", help="file to write (default: print the path of a generated file)")
    s.set_defaults(func=_cmd_accelerate_config)

    s = sub.add_parser("report", help="print a run's speedup report; plot or compare runs")
    s.add_argument("path", help="a run's output_dir or its speedup_report.json")
    s.add_argument("--plot", metavar="PNG")
    s.add_argument("--compare", nargs="+", metavar="RUN", help="more runs to put side by side")
    s.set_defaults(func=_cmd_report)

    s = sub.add_parser("demo", help="fine-tune the embedded tiny model with a preset")
    s.add_argument("--preset", default="auto")
    s.add_argument("--max-steps", type=int, default=60)
    s.add_argument("--output-dir", default="outputs/demo")
    s.set_defaults(func=_cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    from .config import SpeedupConfigError

    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns) or 0
    except SpeedupConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
