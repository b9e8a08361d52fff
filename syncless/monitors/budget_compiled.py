"""What monitors whose hooks run inside torch.compile'd graphs cost, from step times.

A traced hook cannot be timed: a clock read or a timing event in it would break the
graph. Billed nothing, such monitors looked free to the budget, which ran them every
step: +1.5% to +4.3% over the compiled step on three H200 models (bench/RESULTS.md,
compiled_models at 334ce0d). Their cost shows in the step time instead. Under compile
the budget keeps their cadences at powers of two of at least 2
(``syncless.monitors.budget``), so

* every other step runs none of them: the baseline step;
* the monitors active at a step are those with the shortest cadences: the sets of
  active monitors form a chain ``{} < S1 < S2 < ...``.

The cost of ``S`` is the median step time over the steps that ran exactly ``S``, less
the baseline's; each step up the chain is split equally among the monitors it adds.
Medians over ``WINDOW`` steps per set: one slow step (a checkpoint, a straggler) moves
nothing.
"""

from __future__ import annotations

import statistics
from collections import deque
from itertools import pairwise

WINDOW = 9  # steps per set of active monitors a median is taken over
MIN_STEPS = 3  # steps a set needs before its median is used


class StepDeltas:
    """Step times by the set of compiled monitors active in them, and the costs that
    their differences give (ms per active step of each monitor)."""

    def __init__(self) -> None:
        self._steps: dict[frozenset[str], deque[float]] = {}

    def add(self, step_ms: float, active: frozenset[str]) -> dict[str, float]:
        """One step's time (less the costs billed otherwise) and the compiled monitors
        active in it; returns the estimates this step refreshed: those of ``active``,
        once it and every set below it on the chain have ``MIN_STEPS`` steps."""
        self._steps.setdefault(active, deque(maxlen=WINDOW)).append(step_ms)
        if not active:
            return {}
        chain = self._chain(active)
        if chain is None:
            return {}
        out: dict[str, float] = {}
        for below, above in pairwise(chain):
            added = above - below
            delta = statistics.median(self._steps[above]) - statistics.median(self._steps[below])
            for m in added:
                out[m] = max(0.0, delta) / len(added)
        return out

    def _chain(self, top: frozenset[str]) -> list[frozenset[str]] | None:
        """``{} < ... < top`` through the sets measured enough, smallest steps first;
        None while the baseline or ``top`` lacks steps."""
        ready = {s for s, steps in self._steps.items() if len(steps) >= MIN_STEPS}
        if frozenset() not in ready or top not in ready:
            return None
        chain = [frozenset()]
        while chain[-1] != top:
            bigger = [s for s in ready if chain[-1] < s <= top]
            chain.append(min(bigger, key=len))  # top itself is always there
        return chain
