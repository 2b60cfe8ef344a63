"""Step times: the steady-state median the throughput figures use, and a bounded series for the report."""

from __future__ import annotations

import statistics
from typing import Iterable, Sequence


def steady_state_step_time(step_times: Sequence[float], warmup: Iterable[int] = ()) -> tuple[float | None, int]:
    """(median step time over steady-state steps, how many steps that is).

    ``warmup`` holds indices into ``step_times`` to exclude (the first step, steps that compiled).
    If every step is warm-up (a very short run), the median of all steps is returned.
    """
    if not step_times:
        return None, 0
    skip = set(warmup)
    steady = [t for i, t in enumerate(step_times) if i not in skip]
    if not steady:
        return float(statistics.median(step_times)), 0
    return float(statistics.median(steady)), len(steady)


class BoundedSeries:
    """Keeps at most ``max_len`` items of an append-only series by halving its resolution when full
    (every other item is dropped and from then on only every 2nd, 4th, ... new item is kept)."""

    def __init__(self, max_len: int = 1024) -> None:
        self.max_len = max(2, int(max_len))
        self.items: list = []
        self.stride = 1
        self._seen = 0

    def append(self, item) -> None:
        if self._seen % self.stride == 0:
            self.items.append(item)
            if len(self.items) > self.max_len:
                self.items = self.items[::2]
                self.stride *= 2
        self._seen += 1

    def __len__(self) -> int:
        return len(self.items)
