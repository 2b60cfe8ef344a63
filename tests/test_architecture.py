"""The package's imports run one way (ARCHITECTURE.md): no cycles, no module importing a higher layer.

Every ``import``/``from ... import`` of an ``hf_speedup`` module counts, also those inside functions:
a lazy import that dodges a cycle is still a cycle in the design.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hf_speedup"

# Lowest first. A module may import its own layer or lower ones; within a layer the graph must be acyclic.
LAYERS: list[tuple[str, ...]] = [
    ("_version", "compat", "dtypes", "blocks", "tiny", "cpu_allocator", "peak_flops", "gguf",
     "credentials", "callback_handler"),  # leaves: shims and helpers
    ("config",),  # the request
    ("presets",),  # named requests
    ("hardware",),  # Capabilities
    ("model_info", "model_parts", "model_shape", "memory_model",
     "memory_model_types"),  # what the plan may know of a model; memory formulas (and their types)
    ("plan_types",),  # Decision, Outcome, Plan
    ("features",),  # one module (or package) per acceleration
    ("plan",),  # build_plan: orders the features' decisions
    ("stock", "loading", "accelerate_config", "inputs", "estimate"),  # what a plan means outside SpeedupTrainer; input checks
    ("report",),  # the report's schema, collection and sinks
    ("scaling",),  # a cluster plan: the memory estimate per rank, collectives, a step-time bound by the report's FLOPs
    ("trainer",),  # SpeedupTrainer: composes plan, features and report
    ("bench",),  # hf-speedup bench: presets against the peers, one worker process per variant
    ("trl_support",),  # SpeedupSFTTrainer: the mixin on TRL's SFTTrainer (imports trl)
    ("cli", "demo", "__init__"),  # entry points
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _unit(module: str) -> str:
    """The layer unit of a module: its top-level name inside the package (``features.fsdp`` -> ``features``)."""
    return module.split(".")[0]


def _imports(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text())
    package_parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target + "." + a.name if not node.module else target for a in node.names]
                out.update(n.strip(".") for n in names)
            elif node.module and (node.module == "hf_speedup" or node.module.startswith("hf_speedup.")):
                out.add(node.module[len("hf_speedup"):].strip("."))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("hf_speedup."):
                    out.add(a.name[len("hf_speedup."):])
    return {t for t in out if t}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = set()
        for t in _imports(path, name if name != "__init__" else ""):
            # "features.fsdp.Settings" style names resolve to the longest existing module prefix
            parts = t.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts:
                targets.add(".".join(parts))
        graph[name] = targets - {name}
    return graph


def test_every_module_has_a_layer():
    unknown = sorted({_unit(m) for m in _graph()} - set(RANK))
    assert not unknown, f"modules without a layer in LAYERS (add them, and to ARCHITECTURE.md): {unknown}"


def test_no_module_imports_a_higher_layer():
    upward = [f"{m} -> {t}" for m, targets in _graph().items() for t in targets
              if RANK.get(_unit(t), -1) > RANK.get(_unit(m), -1)]
    assert not upward, "imports pointing up the layers:\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("bad, expected", [
    ("from .plan import build_plan", "config -> plan"),
    ("from ..trainer import SpeedupTrainer", "features.x -> trainer"),
])
def test_the_checker_sees_lazy_upward_imports(tmp_path, monkeypatch, bad, expected):
    """The graph reads imports inside functions too (a test that could not fail would prove nothing)."""
    module = "config" if expected.startswith("config") else "features.x"
    path = tmp_path / ("config.py" if module == "config" else "x.py")
    path.write_text(f"def later():\n    {bad}\n")
    targets = _imports(path, module)
    assert any(_unit(t) in ("plan", "trainer") for t in targets), targets


def test_every_feature_has_the_contract_and_says_where_it_acts():
    """The contract of features/__init__.py, checked on every registered feature: one name across module,
    config section and plan; the four functions; ``APPLIES_TO`` (when given) one of the allowed values."""
    from hf_speedup.config import SpeedupConfig
    from hf_speedup.features import FEATURES
    from hf_speedup.plan import build_plan
    from hf_speedup.tiny import tiny_llama

    sections = {f.name for f in dataclasses.fields(SpeedupConfig)}
    plan = build_plan("auto", model=tiny_llama())
    for feature in FEATURES:
        assert feature.__name__.rsplit(".", 1)[1] == feature.NAME, feature.__name__
        assert feature.NAME in sections and feature.NAME in plan.decisions, feature.NAME
        assert all(callable(getattr(feature, fn, None)) for fn in ("decide", "training_args", "apply", "verify"))
        assert getattr(feature, "APPLIES_TO", "args") in {"args", "model", "train"}, feature.NAME
    assert [f.NAME for f in FEATURES if hasattr(f, "during_train")] == ["interrupt"]
