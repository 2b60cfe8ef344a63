"""`hf-speedup` command: presets, plan, estimate, accelerate-config, report, bench, demo."""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager


class CliError(Exception):
    """A user mistake on the command line: printed as one line on stderr, exit status 2, no traceback."""


@contextmanager
def _writing(what: str, target):
    """Turn an OSError while writing ``target`` into a CliError naming the option, the path and the fix."""
    try:
        yield
    except OSError as exc:
        raise CliError(f"{what} {str(target)!r}: cannot write there ({exc.strerror or exc}); fix: choose a "
                       "writable path") from None


def _cmd_presets(ns) -> int:
    from .report.console import table
    from .presets import list_presets, write_preset_yamls

    if ns.write:
        with _writing("presets --write", ns.write):
            written = write_preset_yamls(ns.write)
        for p in written:
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

    from .loading import split_gguf

    try:
        path, gguf_file = split_gguf(ns.model, {})  # a .gguf file carries its config, as load_model reads it
        config = AutoConfig.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {}))
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError) as exc:  # no such path / id, no config.json, not a causal LM
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CliError(f"plan --model {ns.model!r}: no causal-LM config could be read there ({first}); fix: give a "
                       "local model directory holding config.json, or a hub id that is reachable or cached, or "
                       "use --tiny") from None


def _probe(ns):
    """The capabilities of the device a run launched like this trains on (``--cpu``: TrainingArguments' use_cpu)."""
    from types import SimpleNamespace

    from .hardware import probe

    return probe(SimpleNamespace(use_cpu=True) if ns.cpu else None)


def _cmd_plan(ns) -> int:
    from .model_info import describe_model
    from .plan import build_plan, measure
    from .presets import resolve
    from .report import Report

    config = resolve(ns.preset if not ns.config else ns.config)  # a bad config fails before any model is built
    model = _load_model_for_plan(ns)
    info = describe_model(model) if model is not None else None
    report = Report(build_plan(config, measure(config, _probe(ns), info), info))
    if ns.json:
        import json

        print(json.dumps(report.to_dict()["plan"], indent=2))
    else:
        print(report.table())
    return 0


def _cmd_accelerate_config(ns) -> int:
    from .accelerate_config import write_accelerate_config

    with _writing("accelerate-config --output", ns.output):
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
        with _writing("report --plot", ns.plot):
            report_cli.plot_report(ns.path, ns.plot)
        print(f"plot written to {ns.plot}")
    return 0


def _cmd_demo(ns) -> int:
    from .demo import run_demo

    run_demo(ns.preset, max_steps=ns.max_steps, output_dir=ns.output_dir)
    return 0


def _deepspeed_args(ns, caps):
    """TrainingArguments carrying ``--deepspeed`` (None without it), as a run launched with that config has them."""
    if not getattr(ns, "deepspeed", None):
        return None
    import os

    if not os.path.isfile(ns.deepspeed):
        raise CliError(f"estimate --deepspeed {ns.deepspeed!r}: no such file; fix: a DeepSpeed JSON config, e.g. "
                       "configs/deepspeed/zero3.json")
    from transformers import TrainingArguments

    return TrainingArguments(output_dir="hf_speedup_estimate", deepspeed=ns.deepspeed, report_to=[],
                             use_cpu=caps.device_type == "cpu")


def _cmd_estimate(ns) -> int:
    """The breakdown table, whether it fits this device (or --memory), and the cheapest change that would."""
    import json

    from .config import SpeedupConfigError, parse_size
    from .estimate import cheapest_fit, describe_for_estimate, estimate_described, fits_text
    from .memory_model import fmt_bytes
    from .presets import resolve
    from .report.console import fmt_params, table

    config = resolve(ns.preset)  # a bad preset fails before any model is built
    if ns.tiny or not (ns.model or ns.config):
        from .tiny import tiny_llama

        source = tiny_llama()
    else:
        source = ns.model or (json.loads(ns.config) if ns.config.lstrip().startswith("{") else ns.config)
    try:
        described = describe_for_estimate(source)
    except SpeedupConfigError:
        raise  # already names the field, the value and the fix
    except (OSError, ValueError) as exc:
        raise CliError(f"estimate: no causal-LM config could be read from {ns.model or ns.config!r} "
                       f"({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}); fix: a "
                       "model directory or config.json, a .gguf file, a cached hub id, or --tiny") from None
    caps = _probe(ns)
    memory = parse_size(ns.memory) if ns.memory else caps.memory_bytes
    if ns.memory and not memory:
        raise CliError(f"estimate --memory {ns.memory!r}: not a size; fix: e.g. --memory 80GB or --memory 24GiB")
    if ns.max_seq_len:
        return _longest(ns, described, config, caps)
    if ns.seq_len is None:
        raise CliError("estimate: --seq-len is missing; fix: --seq-len 2048 (tokens per row), or --max-seq-len "
                       "--budget 20GiB for the longest row that fits")
    ns.batch_size = ns.batch_size or 8
    if ns.nodes is not None:
        return _scaling_plan(ns, described, config, caps, memory if ns.memory or caps.device_type == "cuda" else None)
    kw = dict(batch_size=ns.batch_size, seq_len=ns.seq_len, world_size=ns.world_size,
              gradient_accumulation_steps=ns.grad_accum, caps=caps, padded=ns.padded, args=_deepspeed_args(ns, caps))
    est = estimate_described(described, config, **kw)
    where = "--memory" if ns.memory else f"this device's memory, {caps.device_name}"
    lines = [f"hf_speedup estimate: {described[0].architecture} ({fmt_params(described[0].total_parameters)} "
             f"parameters), preset '{config.name}' on {caps.device_type}, micro-batch {ns.batch_size} x {ns.seq_len} "
             f"tokens, {ns.world_size} process(es)",
             table(["item", "at peak", "full size", "what"], est.rows(), [22, 11, 11, 30]),
             fits_text(est, memory, where)]
    if est.plan_changes:
        lines.append("memory.budget changed the plan: " + "; ".join(est.plan_changes))
    fits = memory is not None and est.fits(memory)
    verdict = {"memory_bytes": memory, "fits": fits, "cheapest_change": None, "cheapest_change_bytes": None}
    if memory and not fits:
        chosen, text = cheapest_fit(described, config, memory, **kw)
        lines.append(f"cheapest change that fits: {text} (predicted {fmt_bytes(chosen.total_bytes)})" if chosen
                     else f"nothing fits: {text}")
        verdict.update(cheapest_change=text, cheapest_change_bytes=chosen.total_bytes if chosen else None)
    lines += [f"note: {n}" for n in est.notes]
    if ns.json:
        print(json.dumps({**est.to_dict(), **verdict}, indent=2, default=str))
    else:
        print("\n".join(lines))
    return 0 if fits else 1


def _longest(ns, described, config, caps) -> int:
    """``estimate --max-seq-len``: the longest row this preset trains within --budget (hf_speedup.longest_sequence)."""
    import json

    from .estimate import budget_from, longest_described
    from .memory_model import fmt_bytes
    from .report.console import table

    if ns.nodes is not None or ns.seq_len is not None:
        raise CliError("estimate --max-seq-len answers the length: drop " + ("--nodes" if ns.nodes is not None
                                                                            else "--seq-len"))
    budget = budget_from(ns.budget or ns.memory or "auto", caps, "--memory" if ns.memory and not ns.budget else
                         "--budget")
    batch = ns.batch_size or 1
    found = longest_described(described, config, budget_bytes=budget, caps=caps, batch_size=batch, step=ns.step,
                              world_size=ns.world_size, gradient_accumulation_steps=ns.grad_accum, padded=ns.padded,
                              args=_deepspeed_args(ns, caps))
    if ns.json:
        print(json.dumps(found.to_dict(), indent=2, default=str))
        return 0 if found.seq_len else 1
    head = (f"hf_speedup estimate --max-seq-len: {described[0].architecture}, preset '{config.name}' on "
            f"{caps.device_type}, micro-batch {batch}, budget {fmt_bytes(budget)}")
    if found.seq_len is None:
        print(f"{head}\nnothing fits: {'; '.join(found.notes)}")
        return 1
    over = (f"{found.seq_len + found.step:,} tokens need {fmt_bytes(found.over.total_bytes)}" if found.over else
            "longer rows were not searched")
    lines = [head, f"longest row: {found.seq_len:,} tokens (estimate {fmt_bytes(found.estimate.total_bytes)}; {over})",
             f"per token: {fmt_bytes(found.bytes_per_token)}, and {fmt_bytes(found.constant_bytes)} at 0 tokens (the "
             f"slope between rows of {max(1, found.seq_len // 2):,} and {found.seq_len:,} tokens)",
             table(["item", "at peak", "full size", "what"], found.estimate.rows(), [22, 11, 11, 30])]
    print("\n".join(lines + [f"note: {n}" for n in found.notes]))
    return 0


def _scaling_plan(ns, described, config, caps, memory) -> int:
    """``estimate --nodes N``: FSDP against HSDP on N nodes x G GPUs (hf_speedup.scaling)."""
    import json

    from .memory_model import fmt_bytes
    from .report.console import fmt_params, table
    from .scaling import GBIT, Links, fmt_rate, plan_scaling
    from .scaling import table as scaling_table

    if ns.world_size not in (1, ns.nodes * ns.gpus_per_node):
        raise CliError(f"estimate --world-size {ns.world_size} with --nodes {ns.nodes} --gpus-per-node "
                       f"{ns.gpus_per_node}: the world size is nodes x GPUs per node; fix: drop --world-size")
    gpu = ns.gpu or (caps.device_name if caps.device_type == "cuda" else "NVIDIA H100 80GB HBM3")
    memory = memory or H100_MEMORY_BYTES
    plan = plan_scaling(described, config, nodes=ns.nodes, gpus_per_node=ns.gpus_per_node, batch_size=ns.batch_size,
                        seq_len=ns.seq_len, device_name=gpu, memory_bytes=memory, padded=ns.padded,
                        links=Links(intra_node=ns.intra_node_gbps * GBIT, inter_node=ns.inter_node_gbps * GBIT),
                        peak_flops=ns.peak_flops)
    if ns.json:
        print(json.dumps(plan.to_dict(), indent=2, default=str))
        return 0 if plan.chosen else 1
    info = described[0]
    lines = [f"hf_speedup scaling plan: {info.architecture} ({fmt_params(info.total_parameters)} parameters), preset "
             f"'{config.name}', {ns.nodes} node(s) x {ns.gpus_per_node} {gpu} ({plan.world_size} ranks), micro-batch "
             f"{ns.batch_size} x {ns.seq_len} tokens per rank, one optimizer step",
             f"links per GPU: {fmt_rate(plan.links.intra_node)} inside a node (NVLink, one direction), "
             f"{fmt_rate(plan.links.inter_node)} between nodes (NIC); peak {plan.peak_flops / 1e12:,.0f} TFLOP/s; "
             f"{plan.flops_per_token / 1e9:.1f} GFLOP per token; memory per GPU {fmt_bytes(memory)}",
             table(*scaling_table(plan), [24, 28, 28]),
             f"plan: {({'full_shard': 'FSDP', 'hybrid_shard': 'HSDP'}).get(plan.chosen, 'neither')}: {plan.why}",
             "bound: compute at peak and every byte at link speed, all overlapped; latency left out"]
    print("\n".join(lines))
    return 0 if plan.chosen else 1


H100_MEMORY_BYTES = 85_000_000_000  # an H100 80GB as CUDA reports it (79.2 GiB): the scaling plan's default GPU


def _cmd_bench(ns) -> int:
    from .bench.cli import run_from_args

    return run_from_args(ns)


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
    s.add_argument("--cpu", action="store_true", help="for a run on this machine's CPU (TrainingArguments use_cpu, "
                                                      "accelerate launch --cpu) though it has a GPU")
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

    s = sub.add_parser("estimate", help="peak memory of one training step, before loading any weights")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--model", help="local directory, config.json, .gguf file or cached hub id (only its config "
                                   "is read)")
    g.add_argument("--config", help="a transformers model config: a JSON file or inline JSON with model_type")
    g.add_argument("--tiny", action="store_true", help="the embedded tiny Llama (default)")
    s.add_argument("--preset", default="auto", help="preset name or SpeedupConfig YAML (default: auto)")
    s.add_argument("--batch-size", type=int, help="per-device micro-batch (default: 8; 1 with --max-seq-len)")
    s.add_argument("--seq-len", type=int, help="tokens per row (required unless --max-seq-len)")
    s.add_argument("--max-seq-len", action="store_true", help="answer the longest row (tokens) that trains within "
                   "--budget instead, with the bytes per token and the bytes at 0 tokens")
    s.add_argument("--budget", help="with --max-seq-len: memory to fit in, e.g. 20GiB or 24GB (default: --memory, "
                                    "else this device's memory)")
    s.add_argument("--step", type=int, default=1, help="with --max-seq-len: the answer is a multiple of this "
                                                       "(default: 1)")
    s.add_argument("--world-size", type=int, default=1, help="processes (FSDP shards over them)")
    s.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    s.add_argument("--memory", help="memory to fit in, e.g. 80GB or 24GiB (default: this device's memory)")
    s.add_argument("--padded", action="store_true", help="batches carry a padding mask (no packing)")
    s.add_argument("--deepspeed", metavar="CONFIG.json", help="a DeepSpeed config (e.g. configs/deepspeed/zero3.json): "
                   "per-rank memory under its ZeRO stage, over --world-size processes")
    s.add_argument("--cpu", action="store_true", help="for a run on this machine's CPU (TrainingArguments use_cpu, "
                                                      "accelerate launch --cpu) though it has a GPU")
    s.add_argument("--json", action="store_true", help="the estimate as JSON")
    g = s.add_argument_group("scaling plan (FSDP against HSDP on several nodes; hf_speedup.scaling)")
    g.add_argument("--nodes", type=int, help="nodes: print per-rank memory, bytes sent per step and a step-time "
                                             "bound for FSDP and HSDP, and the strategy the plan picks")
    g.add_argument("--gpus-per-node", type=int, default=8, help="GPUs (processes) per node (default: 8)")
    g.add_argument("--gpu", help="GPU name for the peak FLOP/s table (default: this machine's GPU, else H100 SXM; "
                                 "--memory defaults to 80 GB then)")
    g.add_argument("--intra-node-gbps", type=float, default=3600.0,
                   help="NVLink per GPU and direction, Gb/s (default 3600 = 450 GB/s, H100 SXM NVLink 4)")
    g.add_argument("--inter-node-gbps", type=float, default=400.0,
                   help="network per GPU between nodes, Gb/s (default 400: one 400 Gb/s NIC per GPU)")
    g.add_argument("--peak-flops", type=float, help="peak dense FLOP/s per GPU (default: the table's, for the "
                                                    "compute dtype of the plan)")
    s.set_defaults(func=_cmd_estimate)

    from .bench.cli import DESCRIPTION as BENCH_DESCRIPTION, add_arguments as add_bench_arguments

    s = sub.add_parser("bench", help="every preset against the peers on this machine: one table",
                       description=BENCH_DESCRIPTION)
    add_bench_arguments(s)
    s.set_defaults(func=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command. A user mistake (bad config, missing or malformed file, unwritable path) is one line on
    stderr and exit status 2; only a defect of hf_speedup itself shows a traceback."""
    from .config import SpeedupConfigError
    from .report.cli import ReportInputError

    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns) or 0
    except SpeedupConfigError as exc:
        print(f"hf-speedup {ns.command}: error: {'; '.join(exc.problems)}", file=sys.stderr)
        return 2
    except (CliError, ReportInputError) as exc:
        print(f"hf-speedup {ns.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
