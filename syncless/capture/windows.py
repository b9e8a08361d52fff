"""Recurring D2H windows: the pattern, its versions, and the packed boundary word.

A training framework publishes *boundaries* on its stream (``engine.advance_boundary()``),
numbered 0, 1, 2, ... A :class:`WindowPattern` says how they recur: boundary ``n`` lies
in occurrence ``n // period`` at phase ``n % period``, and a window ``(begin, end)`` is
the half-open interval of phases ``[begin, end)``: it OPENs when its occurrence reaches
boundary ``begin`` and CLOSEs at boundary ``end`` (``end == period`` is boundary 0 of
the next occurrence). Everything outside the windows is a critical region where D2H
traffic hurts (an all-to-all, a pipeline send).

Every pattern gets a version from :class:`PatternVersions`; the engine writes
``pack(version, counter)`` to host-visible memory so that a boundary, and the transfer
completions measured against it, can be told apart from those of an older pattern.
"""

from __future__ import annotations

import operator
from bisect import bisect_right
from collections.abc import Iterable
from typing import Any, NamedTuple

__all__ = [
    "COUNTER_BITS",
    "MAX_COUNTER",
    "MAX_VERSION",
    "VERSION_BITS",
    "Location",
    "PatternVersions",
    "WindowPattern",
    "pack",
    "unpack",
]

#: The boundary word is one 64-bit integer: a 16-bit pattern version over a 48-bit
#: boundary counter. 48 bits count a boundary every microsecond for almost nine years.
VERSION_BITS = 16
COUNTER_BITS = 48
MAX_VERSION = (1 << VERSION_BITS) - 1
MAX_COUNTER = (1 << COUNTER_BITS) - 1
_WORD_MASK = (1 << (VERSION_BITS + COUNTER_BITS)) - 1


def _as_int(value: Any, what: str) -> int:
    """``value`` as an int; bools and floats are refused (``2.0`` boundaries is a bug)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got the bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(
            f"{what} must be an integer, got {value!r} ({type(value).__name__})"
        ) from None


class Location(NamedTuple):
    """Where a boundary counter falls: its occurrence, and the window open there."""

    occurrence: int
    #: Index of the window whose ``[begin, end)`` contains the phase; None between windows.
    position: int | None


class WindowPattern:
    """Recurring windows: half-open intervals of boundary counts within a period.

    Args:
        period: boundaries per occurrence (a positive integer).
        windows: ``(begin, end)`` pairs with ``0 <= begin < end <= period``, sorted by
            ``begin`` and non-overlapping (``end`` of one ``<=`` ``begin`` of the next).
            Window ``i`` is window *position* ``i``: the controller learns each
            position's capacity separately.

    Raises:
        ValueError: saying which window is wrong, what was expected and how to fix it.

    Example: a pipeline schedule publishing 4 boundaries per step, with bubbles
    between boundaries 1-2 and 3-4::

        WindowPattern(4, [(1, 2), (3, 4)])
    """

    __slots__ = ("_begins", "_ends", "_period", "_windows")

    def __init__(self, period: int, windows: Iterable[tuple[int, int]]) -> None:
        period = _as_int(period, "WindowPattern: period")
        if period <= 0:
            raise ValueError(
                f"WindowPattern: period must be >= 1 (boundaries per occurrence), got "
                f"{period}; pass how many boundaries the framework publishes per recurrence"
            )
        if isinstance(windows, (str, bytes)) or not isinstance(windows, Iterable):
            raise ValueError(
                f"WindowPattern: windows must be a list of (begin, end) pairs, got {windows!r}"
            )
        parsed = tuple(_parse_window(i, w, period) for i, w in enumerate(windows))
        if not parsed:
            raise ValueError(
                "WindowPattern: windows is empty; expected at least one (begin, end) "
                "interval. To drain without windows, declare no pattern (the engine then "
                "batches) or suspend() the engine"
            )
        for i in range(1, len(parsed)):
            (b0, e0), (b1, e1) = parsed[i - 1], parsed[i]
            if b1 < b0:
                raise ValueError(
                    f"WindowPattern: windows must be sorted by begin, but window {i} "
                    f"{(b1, e1)} begins before window {i - 1} {(b0, e0)}; sort them"
                )
            if b1 < e0:
                raise ValueError(
                    f"WindowPattern: window {i - 1} {(b0, e0)} and window {i} {(b1, e1)} "
                    f"overlap; expected non-overlapping intervals (end of one <= begin of "
                    f"the next); merge them into {(b0, max(e0, e1))}"
                )
        self._period = period
        self._windows = parsed
        self._begins = tuple(b for b, _ in parsed)
        self._ends = tuple(e for _, e in parsed)

    @property
    def period(self) -> int:
        return self._period

    @property
    def windows(self) -> tuple[tuple[int, int], ...]:
        return self._windows

    def __len__(self) -> int:
        """Number of window positions."""
        return len(self._windows)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, WindowPattern):
            return NotImplemented
        return self._period == other._period and self._windows == other._windows

    def __hash__(self) -> int:
        return hash((self._period, self._windows))

    def __repr__(self) -> str:
        return f"WindowPattern({self._period}, {list(self._windows)})"

    def locate(self, counter: int) -> Location:
        """The occurrence of boundary ``counter`` and the window open from it, if any."""
        counter = _as_int(counter, "boundary counter")
        if counter < 0:
            raise ValueError(f"boundary counter must be >= 0, got {counter}")
        occurrence, phase = divmod(counter, self._period)
        # bisect over the begins: O(log windows) and no table sized by the period.
        i = bisect_right(self._begins, phase) - 1
        position = i if i >= 0 and phase < self._ends[i] else None
        return Location(occurrence, position)

    def bounds(self, occurrence: int, position: int) -> tuple[int, int]:
        """Boundary counters ``(open, close)`` of window ``position`` in ``occurrence``."""
        occurrence = _as_int(occurrence, "occurrence")
        position = _as_int(position, "window position")
        if occurrence < 0:
            raise ValueError(f"occurrence must be >= 0, got {occurrence}")
        if not 0 <= position < len(self._windows):
            raise ValueError(
                f"window position {position} out of range: the pattern has "
                f"{len(self._windows)} window(s), positions 0..{len(self._windows) - 1}"
            )
        begin, end = self._windows[position]
        base = occurrence * self._period
        return base + begin, base + end


def _parse_window(i: int, window: Any, period: int) -> tuple[int, int]:
    try:
        begin, end = window
    except (TypeError, ValueError):
        raise ValueError(
            f"WindowPattern: window {i} is {window!r}; expected a (begin, end) pair of "
            f"boundary counts"
        ) from None
    begin = _as_int(begin, f"WindowPattern: window {i} begin")
    end = _as_int(end, f"WindowPattern: window {i} end")
    if begin >= end:
        raise ValueError(
            f"WindowPattern: window {i} is {(begin, end)}; expected begin < end (the "
            f"half-open interval [begin, end) of boundaries); an empty window carries "
            f"nothing, drop it"
        )
    if begin < 0 or end > period:
        raise ValueError(
            f"WindowPattern: window {i} is {(begin, end)}; expected 0 <= begin < end <= "
            f"period = {period}; a window that wraps past the end of the period must be "
            f"split in two, e.g. (6, 8) and (0, 2) for period 8"
        )
    return begin, end


class PatternVersions:
    """Hands out pattern versions: defining a new pattern bumps the version.

    Version 0 means "no pattern yet" (the boundary word before any definition); real
    versions run 1..65535 and then wrap to 1. Versions are only ever compared for
    equality, against transfers still in flight; a wrap confuses two versions only if a
    transfer stays in flight across 65,535 redefinitions, which cannot happen (a
    transfer completes within a few windows).

    Redefining the pattern that is already current keeps its version, and with it what
    the controller has learnt about its windows.
    """

    __slots__ = ("_pattern", "_version")

    def __init__(self) -> None:
        self._version = 0
        self._pattern: WindowPattern | None = None

    @property
    def version(self) -> int:
        return self._version

    @property
    def pattern(self) -> WindowPattern | None:
        return self._pattern

    def define(self, pattern: WindowPattern) -> int:
        """Make ``pattern`` current; returns its version (bumped unless it is unchanged)."""
        if not isinstance(pattern, WindowPattern):
            raise ValueError(
                f"expected a WindowPattern, got {type(pattern).__name__}; build one with "
                f"WindowPattern(period, [(begin, end), ...])"
            )
        if pattern != self._pattern:
            self._version = self._version % MAX_VERSION + 1
            self._pattern = pattern
        return self._version


def pack(version: int, counter: int) -> int:
    """The 64-bit boundary word: ``version`` in the top 16 bits, ``counter`` below."""
    version = _as_int(version, "pattern version")
    counter = _as_int(counter, "boundary counter")
    if not 0 <= version <= MAX_VERSION:
        raise ValueError(f"pattern version must be in [0, {MAX_VERSION}], got {version}")
    if not 0 <= counter <= MAX_COUNTER:
        raise ValueError(f"boundary counter must be in [0, 2**{COUNTER_BITS} - 1], got {counter}")
    return (version << COUNTER_BITS) | counter


def unpack(word: int) -> tuple[int, int]:
    """``(version, counter)`` from a boundary word.

    The word may come back from an int64 tensor, where versions >= 0x8000 read as
    negative numbers; those are taken as their two's-complement 64-bit pattern.
    """
    word = _as_int(word, "boundary word")
    if not -(1 << 63) <= word <= _WORD_MASK:
        raise ValueError(f"boundary word must fit in 64 bits, got {word}")
    word &= _WORD_MASK
    return word >> COUNTER_BITS, word & MAX_COUNTER
