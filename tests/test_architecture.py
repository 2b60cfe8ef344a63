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
     "credentials", "callback_handler", "measured"),  # leaves: shims and helpers
    ("config",),  # the request
    ("presets",),  # named requests
    ("hardware",),  # Capabilities
    ("model_info", "model_parts", "model_shape", "memory_model",
     "memory_model_types", "memory_model_lora"),  # what the plan may know of a model; memory formulas (types, LoRA terms)
    ("plan_types",),  # Decision, Outcome, Plan
    ("features",),  # one module (or package) per acceleration
    ("plan",),  # build_plan: orders the features' decisions; plan_for: the door for a loose request
    ("runner",),  # Speedup: the feature protocol every trainer class and the stock-Trainer helpers drive
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
    ("from .plan import plan_for", "config -> plan"),
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
    from hf_speedup.plan import plan_for
    from hf_speedup.tiny import tiny_llama

    sections = {f.name for f in dataclasses.fields(SpeedupConfig)}
    plan = plan_for("auto", model=tiny_llama())
    for feature in FEATURES:
        assert feature.__name__.rsplit(".", 1)[1] == feature.NAME, feature.__name__
        assert feature.NAME in sections and feature.NAME in plan.decisions, feature.NAME
        assert all(callable(getattr(feature, fn, None)) for fn in ("decide", "training_args", "apply", "verify"))
        assert getattr(feature, "APPLIES_TO", "args") in {"args", "model", "train"}, feature.NAME
    assert [f.NAME for f in FEATURES if hasattr(f, "during_train")] == ["interrupt"]


# Modules that drive every feature the same way: none of them may know one by name.
FEATURE_BLIND = ("trainer", "trl_support", "stock", "runner")


def _feature_names() -> set[str]:
    from hf_speedup.features import FEATURES

    return {feature.NAME for feature in FEATURES}


def _named_features(path: Path, module: str, names: set[str]) -> list[str]:
    """Where ``path`` reaches a feature by name: an import of its module (``from .features import data``,
    ``from .features.lora import x``) or the name as a string (``outcomes["lora"]``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            target = (node.module or "") if not node.level else "." * node.level + (node.module or "")
            parts = target.lstrip(".").split(".")
            if parts[0] == "features" or target.startswith("hf_speedup.features"):
                parts = parts[1:] if parts[0] == "features" else parts[2:]
                reached = parts[:1] or [a.name for a in node.names]
                found += [f"{module} imports features.{n} (line {node.lineno})" for n in reached if n in names]
        elif isinstance(node, ast.Constant) and node.value in names:
            found.append(f"{module} names {node.value!r} (line {node.lineno})")
    return found


def test_the_trainers_and_the_runner_name_no_feature():
    """The trainer classes, the stock-Trainer helpers and the runner reach features only through ``FEATURES`` and
    their hooks: no import of a feature's module, no feature name as a string (``outcomes["lora"]``)."""
    names = _feature_names()
    found = [line for module in FEATURE_BLIND for line in _named_features(PACKAGE / f"{module}.py", module, names)]
    assert not found, "\n".join(found)


def test_the_blindness_check_sees_a_feature_named(tmp_path):
    """The check above can fail: imports of a feature in either form, and a feature's name as a key, are caught."""
    path = tmp_path / "trainer.py"
    path.write_text("from .features import data as data_feature, Setup\nfrom .features.crash_safe import x\n"
                    "from .features.explicit_args import y\nz = outcomes['lora']\n")
    found = _named_features(path, "trainer", _feature_names())
    assert found == ["trainer imports features.data (line 1)", "trainer imports features.crash_safe (line 2)",
                     "trainer names 'lora' (line 4)"]


def test_the_trainer_methods_features_override_are_the_mixins_bases():
    """``SpeedupMixin`` is made of the features' ``TRAINER_HOOKS`` in ``FEATURES`` order, so a feature that needs a
    Trainer method declares it and the trainer does not change."""
    from hf_speedup.features import FEATURES
    from hf_speedup.trainer import SpeedupMixin

    declared = tuple(f.TRAINER_HOOKS for f in FEATURES if hasattr(f, "TRAINER_HOOKS"))
    assert SpeedupMixin.__bases__ == declared and len(declared) >= 3
    assert {f.NAME for f in FEATURES if hasattr(f, "TRAINER_HOOKS")} >= {"fsdp", "data", "crash_safe"}


MAX_LINES = 400


def test_no_module_passes_the_size_of_one_job():
    """A module over ~400 lines holds several jobs: split it by job (a feature with helpers is a package)."""
    big = {p.relative_to(PACKAGE).as_posix(): n for p in PACKAGE.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"


def test_each_feature_is_one_module_or_one_package():
    """Helpers that serve one feature live inside its package: the top of ``features/`` holds the features and the
    helpers several of them share, nothing else."""
    names = _feature_names()
    shared = {"__init__", "explicit_args", "fallback", "probe"}  # used by several features
    top = {p.stem for p in (PACKAGE / "features").glob("*.py")} | {
        p.name for p in (PACKAGE / "features").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert top - names - shared == set(), f"not a feature nor a shared helper: {sorted(top - names - shared)}"
