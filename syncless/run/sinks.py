"""Where step records go. Every sink takes batches of StepRecords; later issues add more."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TextIO, runtime_checkable

from syncless.run.records import StepRecord


@runtime_checkable
class Sink(Protocol):
    """A destination for step records.

    ``write`` is called on the cold path (after a step), never inside a hook. It should
    return quickly: sinks that do I/O hand the batch to a background thread.
    """

    def write(self, records: Sequence[StepRecord]) -> None: ...

    def close(self) -> None: ...


class ConsoleSink:
    """Prints the records of selected metrics, one line per step, every ``every`` steps.

    Meant for logs and scripts; the demo's live view is a richer sink of its own.
    """

    def __init__(
        self,
        names: Sequence[str] | None = None,
        every: int = 1,
        file: TextIO | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"ConsoleSink(every={every}): expected a positive step interval")
        self.names = set(names) if names is not None else None
        self.every = every
        self.file = file

    def write(self, records: Sequence[StepRecord]) -> None:
        by_step: dict[tuple[int, int], list[StepRecord]] = {}
        for r in records:
            if r.step % self.every == 0 and (self.names is None or r.name in self.names):
                by_step.setdefault((r.step, r.rank), []).append(r)
        for (step, rank), recs in sorted(by_step.items()):
            values = "  ".join(f"{r.name}={r.value:.6g}" for r in recs)
            print(f"step {step} rank {rank}  {values}", file=self.file, flush=True)

    def close(self) -> None:
        pass
