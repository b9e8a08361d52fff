"""What the grant controller knows about each window position, and how it learns it.

The per-position evidence (A, B, E), the budget it yields, and the rules that update
it from a clean completion. :class:`~syncless.capture.controller.GrantController`
owns the state (one :class:`WindowState` per position, one bandwidth history for all
of them) and decides which completions are clean; these functions are the rules.

Evidence per window position
    A (``safe_bytes``): the largest transfer proven to finish before the CLOSE.
    B (``unsafe_bytes``): the smallest transfer proven to finish at or after it.
    E (``estimate_bytes``): bytes the window could carry by timing, from the latest
    ``estimate_history`` clean transfers that reported device timings: the
    ``estimate_quantile`` (default 10%) of their ``nbytes / transfer_s * window_s``
    (measured bandwidth times window duration), times ``estimate_margin`` (the issue
    latency and bandwidth jitter the measurement does not see). A low quantile, not the
    latest value: a window whose length varies is budgeted for its short occurrences
    (in the simulator, 40-50% fewer overruns at 30% jitter than with the latest alone).

Budget (the bytes a window may carry next)
    * no evidence: everything transferable (up to the staging bytes);
    * only B: B / 2;
    * A and B: their midpoint, until the bracket is narrow (``B - A <= converged_fraction
      * B``); then A, because the few bytes left are not worth an overrun per occurrence;
    * only A: A, or E when it is larger (E is how a window learns it can carry more than
      it has been offered so far).
    The budget never exceeds the staging bytes, nor (``short_occurrence_cap``, on by
    default), once the engine passes window durations (``window_s``) and a clean
    transfer has measured the D2H bandwidth, what the window's short occurrences can
    carry: the ``estimate_quantile`` of the durations of its latest ``estimate_history``
    occurrences times the recent bandwidth (median) times ``estimate_margin``
    (``short_occurrences``). Why: A is what the window's *long* occurrences proved; on
    the H200s' host-bound expert-parallel step a window's length varies from one step
    to the next (one that had carried 32 MiB, a 0.61 ms copy, lasted 0.37-0.49 ms in
    three later steps at 9b1b4da), so a budget of A overran in the short ones, over and
    over, each overrun a capacity shift that A and E relearnt from the long ones. Every
    occurrence's duration is evidence here, not only those that carried a transfer. On
    a window of fixed length the cap is E's margin below its capacity, reached after
    one clean transfer instead of a bisection: the rules above, bisection included, are
    what the controller does without timings (``short_occurrence_cap=False`` runs them
    alone).

Learning, from clean transfers only
    Completion before the CLOSE raises A; at or after it lowers B; an overrun at or below
    A means the window shrank (a capacity shift): A and E are dropped (E is re-measured
    from this transfer if it carries timings) and B is set there, so the next budget
    halves from it. A transfer issued late after a drain stall, or whose
    CLOSE was observed late, is no evidence either way: it leaves A, B and E untouched.
    B expires ``unsafe_expiry`` occurrences after it was set, so one bad occurrence does
    not cap a window forever. Completions of grants from an older pattern version or
    from before a suspend() or resume(), and completions reported while suspended,
    never update learning.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from syncless.capture.controller.config import ControllerConfig, is_real
from syncless.capture.controller.types import Grant, GrantReason, Outcome

__all__ = [
    "WindowState",
    "forget_expired_unsafe",
    "learn_from_transfer",
    "median_bandwidth",
    "note_duration",
    "window_budget",
]


@dataclass
class WindowState:
    """Mutable per-position state; see the module docstring for A, B and E."""

    safe: int | None = None
    unsafe: int | None = None
    unsafe_at: int = 0
    estimate: int | None = None
    #: Capacities (bytes, before the margin) measured in the latest clean occurrences.
    capacities: deque[float] = field(default_factory=deque)
    #: Durations (s) of its latest occurrences, as the engine passed them to grant().
    durations: deque[float] = field(default_factory=deque)
    failed_probes: int = 0
    probe_allowed_from: int = 0


def note_duration(w: WindowState, window_s: float, config: ControllerConfig) -> None:
    """Keep the window's duration in its previous occurrence, as the engine passed it to
    grant(): every occurrence's duration is evidence for the short-occurrence cap."""
    _check_duration(window_s)
    w.durations.append(window_s)
    if len(w.durations) > config.estimate_history:
        w.durations.popleft()


def forget_expired_unsafe(
    windows: Iterable[WindowState], occurrence: int, config: ControllerConfig
) -> None:
    """B expires ``unsafe_expiry`` occurrences after it was set."""
    expiry = config.unsafe_expiry
    for w in windows:
        if w.unsafe is not None and occurrence - w.unsafe_at >= expiry:
            w.unsafe = None


def median_bandwidth(bandwidths: Iterable[float]) -> float:
    """Bytes/s of the recent clean transfers (their median); callers check any."""
    return statistics.median(bandwidths)


def window_budget(
    w: WindowState, staging: int, config: ControllerConfig, bandwidths: deque[float]
) -> tuple[int, GrantReason]:
    """The bytes ``w`` may carry at its next OPEN, and why (module docstring)."""
    a, b, e = w.safe, w.unsafe, w.estimate
    if a is None and b is None:
        budget, reason = staging, GrantReason.NO_EVIDENCE
    elif a is None:
        budget, reason = b // 2, GrantReason.HALVE
    elif b is None:
        if e is not None and e > a:
            budget, reason = e, GrantReason.ESTIMATE
        else:
            budget, reason = a, GrantReason.SAFE
    elif b - a <= config.converged_fraction * b:
        budget, reason = a, GrantReason.CONVERGED
    else:
        budget, reason = (a + b) // 2, GrantReason.MIDPOINT
    budget = min(budget, staging)
    cap = _short_occurrences_cap(w, config, bandwidths)
    if cap is not None and cap < budget:
        return cap, GrantReason.SHORT_OCCURRENCES
    return budget, reason


def _short_occurrences_cap(
    w: WindowState, config: ControllerConfig, bandwidths: deque[float]
) -> int | None:
    """What the window's short recent occurrences can carry (module docstring)."""
    if not (config.short_occurrence_cap and w.durations and bandwidths):
        return None
    short = _low_quantile(w.durations, config.estimate_quantile)
    return round(short * median_bandwidth(bandwidths) * config.estimate_margin)


def learn_from_transfer(
    w: WindowState,
    grant: Grant,
    before_close: bool,
    transfer_s: float | None,
    window_s: float | None,
    config: ControllerConfig,
    bandwidths: deque[float],
) -> Outcome:
    """Update ``w`` (and ``bandwidths``) from a clean completion of ``grant``.

    The caller has already set aside the completions that are no evidence (stale,
    suspended, interrupted, after the fallback, issued late, CLOSE observed late)."""
    x = grant.nbytes
    if x == 0:
        # Empty records only: an empty copy proves nothing about the window.
        return Outcome.SAFE if before_close else Outcome.UNSAFE
    if before_close:
        if w.safe is None or x > w.safe:
            w.safe = x
        if w.unsafe is not None and x >= w.unsafe:
            w.unsafe = None  # contradicted: the window grew, or B was noise
        if grant.probe:
            w.failed_probes = 0
            w.probe_allowed_from = 0
        _estimate(w, x, transfer_s, window_s, config, bandwidths)
        return Outcome.SAFE

    if w.safe is not None and x <= w.safe:
        # It carried this much before and no longer does: the window shrank. What
        # was safe is stale, and so is a timing estimate from before the shift.
        w.safe = None
        w.estimate = None
        w.capacities.clear()
        w.unsafe, w.unsafe_at = x, grant.occurrence
        outcome = Outcome.CAPACITY_SHIFT
    else:
        if w.unsafe is None or x <= w.unsafe:
            w.unsafe, w.unsafe_at = x, grant.occurrence
        outcome = Outcome.UNSAFE
    if grant.probe:
        w.failed_probes += 1
        skip = min(2 ** (w.failed_probes - 1), config.probe_cooldown_max)
        w.probe_allowed_from = grant.occurrence + 1 + skip
    _estimate(w, x, transfer_s, window_s, config, bandwidths)
    return outcome


def _estimate(
    w: WindowState,
    nbytes: int,
    transfer_s: float | None,
    window_s: float | None,
    config: ControllerConfig,
    bandwidths: deque[float],
) -> None:
    """E from the latest clean transfers: a low quantile of their capacities.

    One long window must not raise the budget of the short ones that follow: with
    the latest transfer alone, a window whose length varies overran whenever a long
    occurrence came before a short one. A capacity shift clears the history (it is
    stale), so E still tracks a change from the next clean transfer on."""
    if transfer_s is None or window_s is None:
        return
    if not (math.isfinite(transfer_s) and math.isfinite(window_s)):
        raise ValueError(
            f"transfer_s and window_s must be finite, got {transfer_s!r}, {window_s!r}"
        )
    if transfer_s < 0 or window_s < 0:
        raise ValueError(f"transfer_s and window_s must be >= 0, got {transfer_s!r}, {window_s!r}")
    if transfer_s == 0 or nbytes == 0:
        return  # no bandwidth to measure
    bandwidths.append(nbytes / transfer_s)
    while len(bandwidths) > config.bandwidth_history:
        bandwidths.popleft()
    w.capacities.append(nbytes / transfer_s * window_s)
    while len(w.capacities) > config.estimate_history:
        w.capacities.popleft()
    low = _low_quantile(w.capacities, config.estimate_quantile)
    # Rounded, not floored: 9e6 computed in floats must not come out as 8999999.
    w.estimate = round(low * config.estimate_margin)


def _low_quantile(values: Iterable[float], quantile: float) -> float:
    """The ``quantile`` of ``values`` (non-empty), a lower order statistic, no
    interpolation: the value of one real occurrence."""
    ordered = sorted(values)
    return ordered[math.floor(quantile * (len(ordered) - 1))]


def _check_duration(window_s: object) -> None:
    if not (is_real(window_s) and math.isfinite(window_s) and window_s >= 0):  # type: ignore[arg-type]
        raise ValueError(f"window_s must be a finite number >= 0, got {window_s!r}")
