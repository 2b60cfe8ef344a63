"""How far ``speedup=`` travels before it becomes a plan: the walk from the trainer's constructor to
``build_plan``'s return, counted in hf_speedup modules.

A module is on the walk when one of its functions is called with the request (the ``speedup=`` value, the
SpeedupConfig made of it, the Plan) or hands one back; consecutive steps in one module are one stay. A
"return" is a stay in a module the walk had already left (the back and forth DESIGN.md rules out).
Two doors are walked: a model object (the common case) and a model id (a local directory: the trainer loads
it before planning).

    python benchmarks/structure_walk.py
"""

from __future__ import annotations

import sys
import tempfile


def _walk(make_trainer, request) -> list[str]:
    """The modules that hold the request (the ``speedup=`` value or the SpeedupConfig made of it) as an argument,
    or get one back, in order, until the trainer's plan exists (``build_plan`` returns a plan for the model)."""
    from hf_speedup.config import SpeedupConfig
    from hf_speedup.plan_types import Plan

    stays: list[str] = []
    done = False

    def holds(value) -> bool:
        return value is request or isinstance(value, (SpeedupConfig, Plan))

    def stay(module: str) -> None:
        short = _unit(module[len("hf_speedup."):] or "hf_speedup")
        if not stays or stays[-1] != short:
            stays.append(short)

    def tracer(frame, event, arg):
        nonlocal done
        module = frame.f_globals.get("__name__", "")
        if done or not module.startswith("hf_speedup"):
            return tracer if not done else None
        code = frame.f_code
        if event == "call" and any(holds(frame.f_locals.get(n)) for n in code.co_varnames[:code.co_argcount
                                                                                          + code.co_kwonlyargcount]):
            stay(module)
        elif event == "return" and holds(arg) and frame.f_back is not None:
            caller = frame.f_back.f_globals.get("__name__", "")
            if caller.startswith("hf_speedup"):
                stay(module)
                stay(caller)
            if code.co_name == "build_plan" and frame.f_locals.get("model") is not None:
                done = True  # the trainer's plan, made for the model (a load-time plan has none)
        return tracer

    sys.settrace(tracer)
    try:
        make_trainer()
    finally:
        sys.settrace(None)
    return stays


def _unit(module: str) -> str:
    """A module inside a package counts as its package (``config.sections`` is ``config``,
    ``features.compile.decision`` is ``features.compile``): splitting a package by job adds no stay."""
    parts = module.split(".")
    return ".".join(parts[:-1]) if len(parts) > 2 or (len(parts) == 2 and parts[0] != "features") else module


def _figures(stays: list[str]) -> tuple[int, int]:
    left: set[str] = set()
    returns = 0
    for before, now in zip(stays, stays[1:]):
        left.add(before)
        if now in left:
            returns += 1
    return len(set(stays)), returns


# The preset name as a string of its own: the literal "auto" is also every section's default, which the walk
# must not take for the request.
REQUEST = "".join(["au", "to"])


def main() -> None:
    from transformers import TrainingArguments

    from hf_speedup import SpeedupTrainer
    from hf_speedup.tiny import char_tokenizer, make_rows, tiny_llama

    tok = char_tokenizer()
    rows = make_rows(tok, n=8, seed=0, pack_to=32)
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=f"{tmp}/out", use_cpu=True, report_to=[], max_steps=1)
        model = tiny_llama(seed=0)
        model.save_pretrained(f"{tmp}/model")
        doors = {
            "model object": lambda: SpeedupTrainer(model=model, args=args, train_dataset=rows, speedup=REQUEST),
            "model id": lambda: SpeedupTrainer(model=f"{tmp}/model", args=args, train_dataset=rows, speedup=REQUEST),
        }
        for door, make in doors.items():
            stays = _walk(make, REQUEST)
            modules, returns = _figures(stays)
            print(f"{door}: {len(stays)} stays, {modules} modules, {returns} returns to a module already left")
            print("  " + " -> ".join(stays))


if __name__ == "__main__":
    main()
