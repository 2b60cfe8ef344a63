"""The one fallback walker: the first choice along a chain that can run here, each skipped one recorded."""

from __future__ import annotations

from typing import Callable, Sequence


def walk_chain(chain: Sequence[str], runnable: Callable[[str], tuple[bool, str]],
               strict_error: Callable[[str, str], Exception] | None = None) -> tuple[str, list[str]]:
    """(first runnable choice, ``"choice: why not"`` for each skipped one).

    With ``strict_error`` the first choice that cannot run raises ``strict_error(choice, why)`` instead:
    the user asked for that choice or nothing. The chain's last choice must always run.
    """
    fallbacks: list[str] = []
    for choice in chain:
        ok, why = runnable(choice)
        if ok:
            return choice, fallbacks
        if strict_error is not None:
            raise strict_error(choice, why)
        fallbacks.append(f"{choice}: {why}")
    raise AssertionError(f"the last choice of {list(chain)} must always run")  # pragma: no cover
