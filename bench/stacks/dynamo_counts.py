"""Dynamo's compiles, graph breaks and recompile-limit hits over some steps, for
bench/stacks/compiled_models.py: a compiled step that recompiles or runs eagerly past the
limit measures something else than the compiled step."""

from __future__ import annotations

import logging
from typing import NamedTuple

from torch._dynamo.utils import counters


class DynamoCounts(NamedTuple):
    """Dynamo's global counters, or their change over some steps."""

    frames: int
    """Frames dynamo converted: first compiles and recompiles (none once a function hit
    the recompile limit: its calls that miss the cache then run eagerly, uncounted)."""
    graphs: int
    breaks: int
    limit_hits: int
    """Warnings that a function hit ``recompile_limit`` (it then runs eagerly)."""
    compile_s: float = 0.0
    """Wall seconds of the steps that compiled (compiling, and running the step)."""

    @classmethod
    def now(cls) -> DynamoCounts:
        breaks = sum(counters["graph_break"].values())
        graphs = counters["stats"]["unique_graphs"]
        return cls(counters["frames"]["total"], graphs, breaks, LIMIT_HITS.count)

    def __sub__(self, other: tuple) -> DynamoCounts:  # type: ignore[override]
        return DynamoCounts(*(a - b for a, b in zip(self, other, strict=True)))

    def __add__(self, other: tuple) -> DynamoCounts:  # type: ignore[override]
        return DynamoCounts(*(a + b for a, b in zip(self, other, strict=True)))

    def text(self) -> str:
        hits = f", {self.limit_hits} recompile-limit hits" if self.limit_hits else ""
        took = f" ({self.compile_s:.1f} s of steps)" if self.frames else ""
        return (
            f"{self.frames} compiles{took}, {self.graphs} graphs, {self.breaks} graph breaks" + hits
        )


class LimitHits(logging.Handler):
    """Counts dynamo's "hit config.recompile_limit" warnings; keeps the first reason."""

    count = 0
    reason = ""
    """The guard that failed last before the first hit, and its source line."""

    def emit(self, record: logging.LogRecord) -> None:
        if "hit config" not in str(record.msg):
            return
        self.count += 1
        args = record.args if isinstance(record.args, tuple) else ()
        if not self.reason and len(args) > 3:  # (limit, value, function, reason, url)
            reason = str(args[3])
            self.reason = reason.partition("# ")[2].partition(" (HINT")[0] or reason[:200]


LIMIT_HITS = LimitHits()
logging.getLogger("torch._dynamo.convert_frame").addHandler(LIMIT_HITS)
ZERO = DynamoCounts(0, 0, 0, 0)
