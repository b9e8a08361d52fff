"""``python -m syncless.capture.simulate TRACE.json``: the grant controller on a trace.

A discrete-event simulation of a recurring window pattern: each occurrence new records
become ready, each window OPENs, the controller grants a prefix of the ready records,
the copy runs at the trace's D2H bandwidth, and its completion (before or after the
window's CLOSE, issued late or not, CLOSE observed late or not) goes back to the
controller. It prints a JSON summary. Time is exact (rational microseconds), so a
trace's outcome can be worked out by hand.

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

Each occurrence: its records become ready; if the ready bytes then exceed
``ring_bytes`` the engine flushes all of them (a capacity flush); after a fallback the
engine batches everything ready once per occurrence; otherwise each window position in
turn sends a record larger than the staging ring by an oversized flush, then asks the
controller for a grant and copies it, starting at the OPEN (plus any stall delay).
Whatever is left at the end goes by a lifecycle flush (``close()``).

Summary fields: ``occurrences``, ``suspended_occurrences``, ``transfers`` (copies under
a window grant), ``overruns`` (of those, the ones that ended at or after the CLOSE),
``bytes_captured``, ``bytes_moved`` (every path) and ``bytes_by_path``,
``bytes_overlapping_critical`` (bytes copied while training was in a critical region:
the part of a window copy after its CLOSE, plus every capacity flush, oversized flush
and batch outside an evaluation phase; rounded to whole bytes; the simulator assumes a
critical region outlasts any overrun and does not model where a batch would land, so it
counts all of it), ``converged_at_occurrence`` (the first occurrence after which the
budgets no longer change; null after a fallback), ``fallback``, ``fallback_reason``,
``fallback_at_occurrence``, ``grants`` (each window position's final budget, in bytes),
``evidence`` (final A, B and E per position), ``flushes`` (by kind) and
``controller_counts`` (grants by reason, completions by outcome, flushes by kind).

A trace that is not valid prints the reason and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from fractions import Fraction
from typing import Any

from syncless.capture.controller import ControllerConfig, FlushKind, GrantController
from syncless.capture.windows import WindowPattern
from syncless.errors import UsageError

__all__ = ["Trace", "TraceError", "load_trace", "main", "parse_trace", "simulate"]

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


# -- simulation --------------------------------------------------------------------------


_PATHS = ("windows", "capacity_flush", "oversized_flush", "batched", "lifecycle_flush")


@dataclass
class _Tally:
    transfers: int = 0
    overruns: int = 0
    captured: int = 0
    overlapping: Fraction = Fraction(0)
    by_path: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_PATHS, 0))


def _jitter(trace: Trace) -> Callable[[int, int], Fraction]:
    """Each window's share of its duration: ``1 - fraction * u``, ``u`` uniform in [0, 1)
    from ``random.Random(seed)``, drawn for every occurrence and position in order (so a
    suspension does not shift the draws), to 6 decimals (exact as a Fraction)."""
    if trace.jitter is None:
        return lambda occ, pos: Fraction(1)
    fraction, seed = trace.jitter
    rng = random.Random(seed)
    n = len(trace.pattern)
    shares = [1 - fraction * Fraction(f"{rng.random():.6f}") for _ in range(trace.occurrences * n)]
    return lambda occ, pos: shares[occ * n + pos]


def simulate(trace: Trace) -> dict[str, Any]:
    """Run ``trace`` through a fresh :class:`GrantController`; returns the summary."""
    ctl = GrantController(trace.staging_bytes, trace.config)
    ctl.define_pattern(trace.pattern)
    positions = range(len(trace.pattern))
    backlog: deque[int] = deque()
    backlog_bytes = 0
    tally = _Tally()
    budgets_after: list[tuple[int, ...]] = []
    fallback_at: int | None = None
    window_us, bytes_per_us = trace.window_us, trace.bytes_per_us
    changes = deque(trace.changes)
    arrivals = trace.records()
    shrink = _jitter(trace)
    last_window: dict[int, Fraction] = {}  # per position, its latest training occurrence

    def drain(path: str, overlapping: bool) -> None:
        nonlocal backlog_bytes
        tally.by_path[path] += backlog_bytes
        if overlapping:
            tally.overlapping += backlog_bytes
        backlog.clear()
        backlog_bytes = 0

    for occ in range(trace.occurrences):
        while changes and changes[0][0] <= occ:
            _, new_windows, new_bandwidth = changes.popleft()
            if new_windows is not None:
                window_us = new_windows
            if new_bandwidth is not None:
                bytes_per_us = new_bandwidth
        training = occ not in trace.suspended
        if training and ctl.suspended:
            ctl.resume()
        elif not training and not ctl.suspended:
            ctl.suspend()

        records = next(arrivals)
        backlog.extend(records)
        backlog_bytes += sum(records)
        tally.captured += sum(records)
        if trace.ring_bytes is not None and backlog_bytes > trace.ring_bytes:
            drain("capacity_flush", overlapping=training)
            ctl.flush(FlushKind.CAPACITY, occ)
            if ctl.fallback and fallback_at is None:
                fallback_at = occ
        if ctl.fallback:
            drain("batched", overlapping=training)
        if training and not ctl.fallback:
            for pos in positions:
                while backlog and backlog[0] > trace.staging_bytes:
                    size = backlog.popleft()
                    backlog_bytes -= size
                    tally.by_path["oversized_flush"] += size
                    tally.overlapping += size
                    ctl.flush(FlushKind.OVERSIZED, occ)
                window = trace.overrides.get((occ, pos), window_us[pos] * shrink(occ, pos))
                # The engine reads the previous occurrence's duration from its stamps.
                previous = last_window.get(pos)
                last_window[pos] = window
                grant = ctl.grant(
                    pos, occ, backlog, None if previous is None else float(previous) / 1e6
                )
                if grant.records == 0:
                    continue
                for _ in range(grant.records):
                    backlog.popleft()
                backlog_bytes -= grant.nbytes
                tally.by_path["windows"] += grant.nbytes
                tally.transfers += 1

                delay = trace.stalls.get((occ, pos), Fraction(0))
                lag = trace.late_close.get((occ, pos), Fraction(0))
                duration = grant.nbytes / bytes_per_us
                end = delay + duration
                if end >= window:  # at or after the CLOSE
                    tally.overruns += 1
                    tally.overlapping += (end - max(delay, window)) * bytes_per_us
                ctl.complete(
                    grant,
                    before_close=end < window + lag,  # what the engine sees
                    issued_late=delay > 0,
                    close_late=lag > 0,
                    transfer_s=float(duration) / 1e6,
                    window_s=float(window) / 1e6,
                )
        budgets_after.append(tuple(ctl.budget(p) for p in positions))

    if backlog:
        drain("lifecycle_flush", overlapping=False)
        ctl.flush(FlushKind.LIFECYCLE, trace.occurrences - 1)
    counts = ctl.counts()

    converged: int | None = None
    if not ctl.fallback:
        converged = len(budgets_after) - 1
        while converged > 0 and budgets_after[converged - 1] == budgets_after[-1]:
            converged -= 1
    evidence = [ctl.evidence(p) for p in positions]
    return {
        "occurrences": trace.occurrences,
        "suspended_occurrences": len(trace.suspended),
        "transfers": tally.transfers,
        "overruns": tally.overruns,
        "bytes_captured": tally.captured,
        "bytes_moved": sum(tally.by_path.values()),
        "bytes_by_path": tally.by_path,
        "bytes_overlapping_critical": round(tally.overlapping),
        "converged_at_occurrence": converged,
        "fallback": ctl.fallback,
        "fallback_reason": ctl.fallback_reason,
        "fallback_at_occurrence": fallback_at,
        "grants": [ctl.budget(p) for p in positions],
        "evidence": [
            {
                "safe_bytes": e.safe_bytes,
                "unsafe_bytes": e.unsafe_bytes,
                "estimate_bytes": e.estimate_bytes,
            }
            for e in evidence
        ],
        "flushes": {kind.value: counts.get(f"flush/{kind.value}", 0) for kind in FlushKind},
        "controller_counts": dict(sorted(counts.items())),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m syncless.capture.simulate",
        description="Run the capture grant controller on a recurring-window trace (JSON) "
        "and print a JSON summary. The trace format is in docs/capture.md.",
    )
    parser.add_argument("trace", help="path to a trace JSON file")
    args = parser.parse_args(argv)
    try:
        summary = simulate(load_trace(args.trace))
    except UsageError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
