"""``python -m syncless.capture.simulate TRACE.json``: the grant controller on a trace.

A discrete-event simulation of a recurring window pattern: each occurrence new records
become ready, each window OPENs, the controller grants a prefix of the ready records,
the copy runs at the trace's D2H bandwidth, and its completion (before or after the
window's CLOSE, issued late or not, CLOSE observed late or not) goes back to the
controller. It prints a JSON summary. Time is exact (rational microseconds), so a
trace's outcome can be worked out by hand.

The trace format is in :mod:`syncless.capture.simulate.trace` (and docs/capture.md).

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
import random
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from syncless.capture.controller import FlushKind, GrantController
from syncless.capture.simulate.trace import Trace, load_trace
from syncless.errors import UsageError

__all__ = ["main", "simulate"]


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
