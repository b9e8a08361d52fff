"""The unit every syncless subsystem emits: one named number for one step on one rank."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Iterator, Sequence
from itertools import repeat
from typing import NamedTuple, overload

# area/scope/name: at least two slash-separated parts of [A-Za-z0-9_.-], e.g.
# `monitors/layer_03/qk_logit_max` or `demo/step/loss`.
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)+$")


class StepRecord(NamedTuple):
    """One value of one metric at one step on one rank.

    ``name`` is ``area/scope/name_unit`` (see ARCHITECTURE.md); ``time`` is the wall
    clock (seconds since the epoch) when the value was produced on the host. A named
    tuple, not a frozen dataclass: monitors emit ~1,500 per step on the training
    thread and a tuple builds in 0.27 us against 0.73 us.
    """

    run: str
    step: int
    rank: int
    name: str
    value: float
    time: float


_new_record = functools.partial(tuple.__new__, StepRecord)


class StepRecords(Sequence[StepRecord]):
    """Step records kept as columns: chunks of ``(run, step, rank, names, values, time)``.

    A monitor flush emits ~1,500 records per step. The Parquet writer thread turns them
    into an Arrow table while holding the GIL the training thread needs: 0.42 ms per
    step of records from tuples, 0.14 from columns (bench/monitors/flush.py, 2-core CPU).
    Iterating
    yields ordinary :class:`StepRecord` s, built on the fly, so a sink reading records
    one by one sees no difference.
    """

    __slots__ = ("_chunks", "_len")

    def __init__(self) -> None:
        self._chunks: list[tuple[str, int, int, list[str], list[float], float]] = []
        self._len = 0

    def add(
        self,
        run: str,
        step: int,
        rank: int,
        names: Iterable[str],
        values: Iterable[float],
        time: float,
    ) -> None:
        """Append records of one step and rank (names and values of equal length)."""
        # The lists are kept, not copied: callers hand over lists nobody mutates later
        # (a readout passes its layout's name list every step), and nothing here does.
        names = names if isinstance(names, list) else list(names)
        values = values if isinstance(values, list) else list(values)
        if len(names) != len(values):
            raise ValueError(f"{len(names)} names for {len(values)} values")
        if names:
            self._chunks.append((run, step, rank, names, values, time))
            self._len += len(names)

    def append(self, record: StepRecord) -> None:
        self.add(record.run, record.step, record.rank, [record.name], [record.value], record.time)

    def extend(self, records: Iterable[StepRecord]) -> None:
        """Append ``records``: another ``StepRecords`` by its chunks (shared, not
        copied), anything else as one chunk per run of records with the same run, step,
        rank and time."""
        if isinstance(records, StepRecords):
            self._chunks += records._chunks
            self._len += records._len
            return
        key: tuple | None = None
        names: list[str] = []
        values: list[float] = []
        for r in records:
            if (r.run, r.step, r.rank, r.time) != key:
                if key is not None:
                    self.add(key[0], key[1], key[2], names, values, key[3])
                key, names, values = (r.run, r.step, r.rank, r.time), [], []
            names.append(r.name)
            values.append(r.value)
        if key is not None:
            self.add(key[0], key[1], key[2], names, values, key[3])

    def chunks(self) -> list[tuple[str, int, int, list[str], list[float], float]]:
        """The columns as appended: ``(run, step, rank, names, values, time)`` each."""
        return self._chunks

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[StepRecord]:
        for run, step, rank, names, values, time in self._chunks:
            fields = zip(repeat(run), repeat(step), repeat(rank), names, values, repeat(time))
            yield from map(_new_record, fields)

    @overload
    def __getitem__(self, index: int) -> StepRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[StepRecord]: ...

    def __getitem__(self, index: int | slice) -> StepRecord | list[StepRecord]:
        if isinstance(index, slice):
            return list(self)[index]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"record {index} of {self._len}")
        for run, step, rank, names, values, time in self._chunks:
            if index < len(names):
                return StepRecord(run, step, rank, names[index], values[index], time)
            index -= len(names)
        raise AssertionError("unreachable: the length counts every chunk")

    def __repr__(self) -> str:
        return f"StepRecords({self._len} records in {len(self._chunks)} chunks)"


def step_records(
    run: str, step: int, rank: int, names: Iterable[str], values: Iterable[float], time: float
) -> StepRecords:
    """Records of one step and rank, kept as columns (:class:`StepRecords`)."""
    out = StepRecords()
    out.add(run, step, rank, names, values, time)
    return out


def check_metric_name(name: str) -> str:
    """Return ``name`` if it is a valid ``area/scope/name`` metric name, else raise."""
    if not _NAME_RE.match(name):
        raise ValueError(
            f"invalid metric name {name!r}: expected 'area/scope/name_unit' "
            "(slash-separated parts of letters, digits, '_', '.', '-'), "
            "e.g. 'demo/step/loss'"
        )
    return name
