"""Credentials in TrainingArguments that must never reach a file.

The stock Trainer pickles its TrainingArguments into every ``checkpoint-*/training_args.bin`` (and into the
folder it pushes to the Hub), ``hub_token`` included. SpeedupTrainer trains with a copy whose credentials are
:class:`Credential` strings: they work as the string they hold (Hub uploads authenticate as before), but
pickle, and so ``torch.save``, writes ``None`` in their place. Every writer of ``training_args.bin`` (the
Trainer's ``_save``, its Hub push, hf_speedup's FSDP save, a subclass's or the user's own ``torch.save``) is
covered at once. JSON, W&B and TensorBoard already get ``<HUB_TOKEN>`` from ``TrainingArguments.to_dict()``.
"""

from __future__ import annotations

import dataclasses
import re

# TrainingArguments (and subclass) fields that hold credentials; vocabulary fields such as TRL's
# ``pad_token``/``eos_token`` are not secrets and stay as they are.
CREDENTIAL_FIELD = re.compile(r"(^|_)(hub_token|auth_token|access_token|api_key|apikey|secret|password)$")


class Credential(str):
    """A secret that is itself wherever it is used, and ``None`` wherever it is pickled."""

    __slots__ = ()

    def __reduce_ex__(self, protocol):
        return (type(None), ())  # unpickles as NoneType() -> None; nothing of hf_speedup needed to load it

    def __reduce__(self):
        return (type(None), ())

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self  # a deep copy of the arguments keeps a working credential

    def __repr__(self) -> str:
        return "'<redacted>'"


def credential_fields(args) -> list[str]:
    """Names of the set credential fields of a TrainingArguments (or subclass) object."""
    if not dataclasses.is_dataclass(args):
        return []
    return [f.name for f in dataclasses.fields(args)
            if CREDENTIAL_FIELD.search(f.name) and isinstance(getattr(args, f.name, None), str)]


def redacted_overrides(args) -> dict:
    """``{field: Credential(value)}`` for every credential not yet wrapped (overrides for a copy of ``args``)."""
    return {name: Credential(getattr(args, name)) for name in credential_fields(args)
            if not isinstance(getattr(args, name), Credential)}
