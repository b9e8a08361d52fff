"""The simulator's input: the trace format, and :func:`parse_trace` / :func:`load_trace`.

A trace describes a recurring window pattern and what happens in it, occurrence by
occurrence; :mod:`syncless.capture.simulate` runs one through the grant controller.
A trace that is not valid raises a :class:`TraceError` that says where and why.

Trace format (JSON object; units are in the key names)::

    {
      "pattern": {"period": 2, "windows": [[0, 1]]},   # WindowPattern(period, windows)
      "occurrences": 20,                 # occurrences to simulate
      "staging_bytes": 67108864,         # the pinned staging ring: no grant exceeds it
      "d2h_gb_per_s": 1,                 # copy bandwidth, 1 GB/s = 1000 bytes per us
      "window_us": [10000],              # duration of each window position
      "records": {"count": 64, "bytes": 1048576},   # ready at the start of each occurrence
      "ring_bytes": 134217728,           # optional: device ring; default unlimited
      "changes": [{"occurrence": 10, "window_us": [2500], "d2h_gb_per_s": 1}],
      "overrides": [{"occurrence": 7, "position": 0, "window_us": 500}],
      "drain_stalls": [{"occurrence": 12, "position": 0, "delay_us": 5000}],
      "late_close": [{"occurrence": 4, "position": 0, "lag_us": 20000}],
      "suspend": [[5, 9]],               # occurrences [5, 9) are an evaluation phase
      "jitter": {"fraction": 0.4, "seed": 1},   # each window 60-100% of its duration
      "controller": {"unsafe_expiry": 64}   # optional ControllerConfig fields
    }

* ``records``: ``{"sizes": [...]}`` (these records, every occurrence), ``{"count": N,
  "bytes": S}`` (N records of S bytes), or ``{"count": N, "min_bytes": LO, "max_bytes":
  HI, "seed": K}`` (N sizes drawn uniformly from [LO, HI] by ``random.Random(K)``).
* ``changes``: capacity shifts; from ``occurrence`` on, the given ``window_us`` (one per
  position) and/or ``d2h_gb_per_s`` replace the trace's. ``overrides``: one window of one
  occurrence only. A window carries ``window_us * d2h_gb_per_s * 1000`` bytes.
* ``drain_stalls``: the copy is issued ``delay_us`` after the OPEN (reported to the
  controller as issued late). ``late_close``: the engine sees the CLOSE ``lag_us`` late,
  so it judges "before the CLOSE" against the late time (and says so). Without
  ``position`` both apply to every window of the occurrence.
* ``suspend``: half-open occurrence intervals between ``suspend()`` and ``resume()``:
  no windows; records accumulate and flushes (if the ring fills) go uncounted.
* ``jitter``: every window of every occurrence lasts ``1 - fraction * u`` of its
  duration, ``u`` uniform in [0, 1) drawn by ``random.Random(seed)`` (default seed 0),
  as real windows do (the compute between two all-to-alls varies with routing). An
  override replaces a window's jittered duration.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Any

from syncless.capture.controller.config import ControllerConfig
from syncless.capture.windows import WindowPattern
from syncless.errors import UsageError

__all__ = ["Trace", "TraceError", "load_trace", "parse_trace"]

_KEYS = {
    "pattern",
    "occurrences",
    "staging_bytes",
    "d2h_gb_per_s",
    "window_us",
    "records",
    "ring_bytes",
    "changes",
    "overrides",
    "drain_stalls",
    "late_close",
    "suspend",
    "jitter",
    "controller",
}
_REQUIRED = ("pattern", "occurrences", "staging_bytes", "d2h_gb_per_s", "window_us", "records")


class TraceError(UsageError):
    """A trace that cannot be simulated; the message says where and why."""


@dataclass(frozen=True)
class Trace:
    """A parsed, validated trace (see the module docstring for the format)."""

    pattern: WindowPattern
    occurrences: int
    staging_bytes: int
    bytes_per_us: Fraction
    window_us: tuple[Fraction, ...]
    records: Callable[[], Iterator[list[int]]]  # a fresh per-occurrence record stream
    ring_bytes: int | None
    changes: tuple[tuple[int, tuple[Fraction, ...] | None, Fraction | None], ...]
    overrides: Mapping[tuple[int, int], Fraction]
    stalls: Mapping[tuple[int, int], Fraction]
    late_close: Mapping[tuple[int, int], Fraction]
    suspended: frozenset[int]
    config: ControllerConfig
    jitter: tuple[Fraction, int] | None = None  # (fraction, seed)


# -- parsing -----------------------------------------------------------------------------


def _number(value: Any, where: str, *, positive: bool = False) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceError(f"{where} must be a finite number, got {value!r}")
    # str() first, so that 0.1 means one tenth, not the nearest binary float.
    number = Fraction(value) if isinstance(value, int) else Fraction(str(value))
    if number < 0 or (positive and number == 0):
        raise TraceError(f"{where} must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return number


def _integer(value: Any, where: str, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(f"{where} must be >= {minimum}, got {value}")
    return value


def _occurrence(value: Any, where: str, occurrences: int) -> int:
    occurrence = _integer(value, where)
    if occurrence >= occurrences:
        raise TraceError(
            f"{where} is {occurrence} but the trace has {occurrences} occurrences "
            f"(0..{occurrences - 1})"
        )
    return occurrence


def _object(value: Any, where: str, keys: set[str], required: tuple[str, ...] = ()) -> dict:
    if not isinstance(value, dict):
        raise TraceError(f"{where} must be a JSON object, got {value!r}")
    unknown = sorted(set(value) - keys)
    if unknown:
        raise TraceError(
            f"{where} has unknown key(s) {', '.join(map(repr, unknown))}; expected keys: "
            f"{', '.join(sorted(keys))}"
        )
    missing = [k for k in required if k not in value]
    if missing:
        raise TraceError(f"{where} is missing {', '.join(map(repr, missing))}")
    return value


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise TraceError(f"{where} must be a JSON list, got {value!r}")
    return value


def _durations(value: Any, where: str, windows: int) -> tuple[Fraction, ...]:
    durations = _list(value, where)
    if len(durations) != windows:
        raise TraceError(
            f"{where} has {len(durations)} entries but the pattern has {windows} window(s); "
            f"give one duration per window position"
        )
    return tuple(_number(d, f"{where}[{i}]") for i, d in enumerate(durations))


def _records(value: Any, where: str) -> Callable[[], Iterator[list[int]]]:
    spec = _object(value, where, {"sizes", "count", "bytes", "min_bytes", "max_bytes", "seed"})
    if "sizes" in spec:
        if set(spec) != {"sizes"}:
            raise TraceError(f"{where}: 'sizes' stands alone; drop the other keys")
        sizes = [
            _integer(s, f"{where}.sizes[{i}]", minimum=1)
            for i, s in enumerate(_list(spec["sizes"], f"{where}.sizes"))
        ]

        def fixed() -> Iterator[list[int]]:
            while True:
                yield list(sizes)

        return fixed
    if "count" not in spec:
        raise TraceError(
            f"{where} must be {{'sizes': [...]}}, {{'count': N, 'bytes': S}} or {{'count': "
            f"N, 'min_bytes': LO, 'max_bytes': HI, 'seed': K}}, got keys {sorted(spec)}"
        )
    count = _integer(spec["count"], f"{where}.count")
    if "bytes" in spec:
        if set(spec) != {"count", "bytes"}:
            raise TraceError(f"{where}: 'count' and 'bytes' stand alone; drop the other keys")
        size = _integer(spec["bytes"], f"{where}.bytes", minimum=1)

        def constant() -> Iterator[list[int]]:
            while True:
                yield [size] * count

        return constant
    if set(spec) != {"count", "min_bytes", "max_bytes", "seed"}:
        raise TraceError(
            f"{where} must be {{'sizes': [...]}}, {{'count': N, 'bytes': S}} or {{'count': "
            f"N, 'min_bytes': LO, 'max_bytes': HI, 'seed': K}}, got keys {sorted(spec)}"
        )
    lo = _integer(spec["min_bytes"], f"{where}.min_bytes", minimum=1)
    hi = _integer(spec["max_bytes"], f"{where}.max_bytes", minimum=lo)
    seed = _integer(spec["seed"], f"{where}.seed")

    def uniform() -> Iterator[list[int]]:
        rng = random.Random(seed)
        while True:
            yield [rng.randint(lo, hi) for _ in range(count)]

    return uniform


def _events(
    value: Any, where: str, key: str, occurrences: int, windows: int
) -> dict[tuple[int, int], Fraction]:
    """``[{"occurrence", "position"?, key}]`` as {(occurrence, position): value}."""
    events: dict[tuple[int, int], Fraction] = {}
    for i, item in enumerate(_list(value, where)):
        at = f"{where}[{i}]"
        item = _object(item, at, {"occurrence", "position", key}, ("occurrence", key))
        occurrence = _occurrence(item["occurrence"], f"{at}.occurrence", occurrences)
        if "position" in item:
            position = _integer(item["position"], f"{at}.position")
            if position >= windows:
                raise TraceError(
                    f"{at}.position is {position} but the pattern has {windows} window(s)"
                )
            positions = [position]
        else:
            positions = list(range(windows))
        amount = _number(item[key], f"{at}.{key}")
        for p in positions:
            events[(occurrence, p)] = amount
    return events


def parse_trace(obj: Any, source: str = "trace") -> Trace:
    """Validate a trace object (parsed JSON); raises :class:`TraceError`."""
    obj = _object(obj, source, _KEYS, _REQUIRED)
    pat = _object(obj["pattern"], f"{source}.pattern", {"period", "windows"}, ("period", "windows"))
    try:
        pattern = WindowPattern(pat["period"], _list(pat["windows"], f"{source}.pattern.windows"))
    except ValueError as e:
        raise TraceError(f"{source}.pattern: {e}") from None
    windows = len(pattern)
    occurrences = _integer(obj["occurrences"], f"{source}.occurrences", minimum=1)

    changes = []
    for i, item in enumerate(_list(obj.get("changes", []), f"{source}.changes")):
        at = f"{source}.changes[{i}]"
        item = _object(item, at, {"occurrence", "window_us", "d2h_gb_per_s"}, ("occurrence",))
        if len(item) == 1:
            raise TraceError(f"{at} changes nothing; give 'window_us' and/or 'd2h_gb_per_s'")
        changes.append(
            (
                _occurrence(item["occurrence"], f"{at}.occurrence", occurrences),
                _durations(item["window_us"], f"{at}.window_us", windows)
                if "window_us" in item
                else None,
                _number(item["d2h_gb_per_s"], f"{at}.d2h_gb_per_s", positive=True) * 1000
                if "d2h_gb_per_s" in item
                else None,
            )
        )
    changes.sort(key=lambda change: change[0])

    suspended: set[int] = set()
    for i, interval in enumerate(_list(obj.get("suspend", []), f"{source}.suspend")):
        at = f"{source}.suspend[{i}]"
        if not (isinstance(interval, list) and len(interval) == 2):
            raise TraceError(f"{at} must be a [start, end) pair of occurrences, got {interval!r}")
        start = _integer(interval[0], f"{at}[0]")
        end = _integer(interval[1], f"{at}[1]")
        if not start < end <= occurrences:
            raise TraceError(
                f"{at} is {interval!r}; expected 0 <= start < end <= occurrences = {occurrences}"
            )
        suspended.update(range(start, end))

    controller = _object(
        obj.get("controller", {}),
        f"{source}.controller",
        {f.name for f in fields(ControllerConfig)},
    )
    try:
        config = ControllerConfig(**controller)
    except ValueError as e:
        raise TraceError(f"{source}.controller: {e}") from None

    jitter = None
    if "jitter" in obj:
        spec = _object(obj["jitter"], f"{source}.jitter", {"fraction", "seed"}, ("fraction",))
        fraction = _number(spec["fraction"], f"{source}.jitter.fraction")
        if fraction >= 1:
            raise TraceError(
                f"{source}.jitter.fraction is {spec['fraction']!r}; expected [0, 1): a window "
                "is at least (1 - fraction) of its duration"
            )
        jitter = (fraction, _integer(spec.get("seed", 0), f"{source}.jitter.seed"))

    ring = obj.get("ring_bytes")
    return Trace(
        pattern=pattern,
        occurrences=occurrences,
        staging_bytes=_integer(obj["staging_bytes"], f"{source}.staging_bytes", minimum=1),
        bytes_per_us=_number(obj["d2h_gb_per_s"], f"{source}.d2h_gb_per_s", positive=True) * 1000,
        window_us=_durations(obj["window_us"], f"{source}.window_us", windows),
        records=_records(obj["records"], f"{source}.records"),
        ring_bytes=None if ring is None else _integer(ring, f"{source}.ring_bytes", minimum=1),
        changes=tuple(changes),
        overrides=_events(
            obj.get("overrides", []), f"{source}.overrides", "window_us", occurrences, windows
        ),
        stalls=_events(
            obj.get("drain_stalls", []), f"{source}.drain_stalls", "delay_us", occurrences, windows
        ),
        late_close=_events(
            obj.get("late_close", []), f"{source}.late_close", "lag_us", occurrences, windows
        ),
        suspended=frozenset(suspended),
        jitter=jitter,
        config=config,
    )


def load_trace(path: str) -> Trace:
    """Read and validate a trace file; raises :class:`TraceError`."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise TraceError(f"cannot read trace {path!r}: {e.strerror or e}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(
            f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    return parse_trace(obj, source=path)
