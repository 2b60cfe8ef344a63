"""Which TrainingArguments values the user chose: an explicit choice wins over a preset's (or the run refuses up
front), so every feature that sets a TrainingArguments field asks here first.

TrainingArguments keep no record of which arguments were passed: a value counts as the user's when it differs
from the field's default, or when :func:`hf_speedup.training_arguments` was given it (it records the names).
"""

from __future__ import annotations

from typing import Any

# The names ``hf_speedup.training_arguments(**kwargs)`` was given are recorded on the TrainingArguments it
# returns: the caller's explicit choices, even where a value equals the field's default.
EXPLICIT_ARGS_ATTR = "hf_speedup_explicit"


def users_choice(args, field_name: str) -> tuple[bool, Any]:
    """(explicit, value) of a TrainingArguments field.

    TrainingArguments keeps no record of which arguments were passed, so a value counts as the user's
    explicit choice when it differs from the field's default as the class resolves it (its ``__post_init__`` may
    turn a declared ``None`` into ``False``), or was given to ``training_arguments()``; a value equal to the
    default cannot be told apart from "not set" and reads as not set.
    """
    import dataclasses

    if args is None or not dataclasses.is_dataclass(args) or not hasattr(args, field_name):
        return False, None
    value = getattr(args, field_name)
    if field_name in getattr(args, EXPLICIT_ARGS_ATTR, ()):
        return True, value
    field = next((f for f in dataclasses.fields(args) if f.name == field_name), None)
    if field is None or field.default is dataclasses.MISSING:
        return False, value
    declared = field.default
    if _same(value, declared):
        return False, value
    if declared == "auto":  # resolved by __post_init__ from other fields: unknowable
        return False, value
    return not _same(value, _resolved_default(args, field_name, declared)), value


def _resolved_default(args, field_name: str, declared: Any) -> Any:
    """The value ``args``' class gives the field when it is left at ``declared``, everything else as in ``args``
    (built as a copy of them: a TrainingArguments built with other device fields would set the process's
    accelerator state up differently); ``declared`` where the copy cannot be built."""
    import warnings

    from ..compat import accelerate_state_kept, replace_args

    try:  # a throw-away copy: accelerate's process-wide state stays as a live Trainer set it up
        with warnings.catch_warnings(), accelerate_state_kept():  # its deprecation notes are the user's to see
            warnings.simplefilter("ignore")
            return getattr(replace_args(args, {field_name: declared}), field_name)
    except Exception:
        return declared


# Fields a preset may still change although you set them: what you asked for happens, another way.
TAKEN_OVER = {
    **{name: "hf_speedup checkpoints the blocks itself (your checkpointing, done once, not by both)"
       for name in ("gradient_checkpointing", "activation_checkpointing", "gradient_checkpointing_kwargs",
                    "activation_checkpointing_kwargs")},
    **{name: "memory.budget (your own config: no preset sets it) splits each batch into micro-batches with "
             "gradient accumulation; the effective batch is kept"
       for name in ("per_device_train_batch_size", "gradient_accumulation_steps")},
    "chat_template_path": "the template was cloned before the adapters were added, as TRL does: not cloned twice",
}


def overridden_choices(args, overrides: dict, feature: str, preset: str) -> list[str]:
    """The problems of ``overrides`` (one feature's TrainingArguments changes) that would replace a value the user
    set: a feature keeps the user's value instead (and says so); one that does not is refused up front here."""
    problems = []
    for name, value in overrides.items():
        explicit, users = users_choice(args, name)
        if name in TAKEN_OVER or not explicit or _same(users, value):
            continue
        problems.append(
            f"TrainingArguments.{name} = {_plain(users)!r} is your explicit choice, and speedup {preset!r} ({feature}) "
            f"would set {_plain(value)!r}; allowed: one of the two; fix: drop {name} from your TrainingArguments to "
            f"take the preset's value, or set the config's {feature} section so that it keeps yours")
    return problems


def _plain(value: Any) -> Any:
    """An enum's value; a list of enum options as the space-separated string TrainingArguments accepts."""
    if isinstance(value, (list, tuple)):
        return " ".join(str(_plain(v)) for v in value)
    return getattr(value, "value", value)


def _same(a: Any, b: Any) -> bool:
    a, b = _plain(a), _plain(b)
    if isinstance(a, str) and isinstance(b, str):
        return sorted(a.split()) == sorted(b.split())
    return a == b
