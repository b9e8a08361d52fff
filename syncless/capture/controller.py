"""The grant controller: how many bytes each recurring window may carry.

Pure Python and deterministic (no torch, no clock, no randomness): the capture engine
tells it what happened, in occurrences of the pattern and bytes, and it answers with
grants. The engine drives it with five calls::

    version = ctl.define_pattern(pattern)       # pack(version, counter) on the device
    g = ctl.grant(position, occurrence, ready,   # a window OPENs; ready = record sizes,
                  window_s=...)                  # its last duration (optional)
    ...copy the first g.records records (g.nbytes bytes) on the copy stream...
    ctl.complete(g, before_close=..., issued_late=..., close_late=...,
                 transfer_s=..., window_s=...)   # once the copy and the CLOSE are known
    ctl.flush(FlushKind.CAPACITY, occurrence)    # the engine drained outside a window
    ctl.suspend() / ctl.resume()                 # around phases without windows

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

Grant (what the engine copies)
    The largest prefix of the ready records whose total is at most the budget: records
    are never split. When the first record alone exceeds the budget it is sent alone (a
    *probe*): a window either proves it carries the smallest thing there is to send, or
    it is skipped. A probe that overruns is not retried at once: after ``f`` consecutive
    failed probes a position skips ``min(2**(f-1), probe_cooldown_max)`` occurrences.
    Nor is a probe sent that timing already rules out: when the engine passes the
    window's duration in its previous occurrence (``window_s``) and the D2H bandwidth
    of recent clean transfers (their median) would not move the first record in it, the
    window is skipped (``too_short``). Why: a window shorter than the smallest record
    can only overrun, and backoff alone still probes it at occurrences 2, 4, 7, 12, 21,
    38, ...; the expert-parallel demo has dozens of such windows per step (the expert
    compute between a dispatch and its combine against a 32 MiB hidden state).

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

Fallback
    A capacity flush is the engine draining outside the windows because its ring filled
    up. ``fallback_flushes`` of them within ``fallback_interval`` occurrences (while
    windows are active) mean the windows cannot carry the capture volume: the controller
    falls back to ordinary batching for good (``fallback`` and ``fallback_reason``).
    Isolated ones age out; lifecycle flushes (close) and oversized-record flushes never
    count, and neither does anything while suspended.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from syncless.capture.windows import PatternVersions, WindowPattern

__all__ = [
    "ControllerConfig",
    "FlushKind",
    "Grant",
    "GrantController",
    "GrantReason",
    "Outcome",
    "WindowEvidence",
]


class GrantReason(str, Enum):
    """Why a grant is what it is."""

    NO_EVIDENCE = "no_evidence"  # neither A nor B: everything transferable
    HALVE = "halve"  # only B: B / 2
    MIDPOINT = "midpoint"  # A < B, bracket still wide
    CONVERGED = "converged"  # A < B, bracket narrow: A
    SAFE = "safe"  # only A, E not larger: A
    ESTIMATE = "estimate"  # only A, E larger: E
    SHORT_OCCURRENCES = "short_occurrences"  # the evidence's budget, capped by timing
    # for the window's short recent occurrences (see the module docstring)
    PROBE = "probe"  # the first record exceeds the budget: it goes alone
    COOLDOWN = "cooldown"  # the first record exceeds the budget, probes backing off
    TOO_SHORT = "too_short"  # the first record exceeds the budget and the window's last
    # duration at the recent bandwidth: no probe
    OVERSIZED = "oversized"  # the first record exceeds the staging bytes: flush it
    NOTHING_READY = "nothing_ready"
    SUSPENDED = "suspended"  # no windows now: everything transferable
    FALLBACK = "fallback"  # windows abandoned: everything transferable


class Outcome(str, Enum):
    """What the controller made of a completion."""

    SAFE = "safe"  # before the CLOSE: A rose (or already covered it)
    UNSAFE = "unsafe"  # at or after the CLOSE: B fell (or already covered it)
    CAPACITY_SHIFT = "capacity_shift"  # at or after the CLOSE at or below A
    STALE_VERSION = "stale_version"  # granted under an older pattern version
    SUSPENDED = "suspended"  # reported while suspended
    INTERRUPTED = "interrupted"  # granted before a suspend() or resume()
    FALLBACK = "fallback"  # the controller has fallen back
    ISSUED_LATE = "issued_late"  # issued late after a drain stall: no evidence
    CLOSE_LATE = "close_late"  # the CLOSE was observed late: no evidence

    @property
    def is_evidence(self) -> bool:
        return self in (Outcome.SAFE, Outcome.UNSAFE, Outcome.CAPACITY_SHIFT)


class FlushKind(str, Enum):
    """Why the engine drained outside a window."""

    CAPACITY = "capacity"  # the ring filled up: counts towards fallback
    LIFECYCLE = "lifecycle"  # close() or an explicit flush: never counts
    OVERSIZED = "oversized"  # a record larger than the staging bytes: never counts


@dataclass(frozen=True)
class ControllerConfig:
    """Tuning knobs; every interval is in occurrences of the pattern."""

    #: B is forgotten this many occurrences after it was set.
    unsafe_expiry: int = 64
    #: Stop bisecting once ``B - A <= converged_fraction * B`` and grant A.
    converged_fraction: float = 0.25
    #: E = measured bandwidth * window duration * estimate_margin.
    estimate_margin: float = 0.9
    #: E is a low quantile of the capacities measured in this many latest clean
    #: occurrences (1: the latest alone) ...
    estimate_history: int = 16
    #: ... this quantile: windows whose length varies from one occurrence to the next
    #: are budgeted for their short occurrences, not for whichever came last.
    estimate_quantile: float = 0.1
    #: The bandwidth that rules probes out is the median of this many latest clean
    #: transfers (any window).
    bandwidth_history: int = 16
    #: Cap every budget at what the window's short recent occurrences carry by timing
    #: (module docstring); False: the evidence rules alone.
    short_occurrence_cap: bool = True
    #: Longest cooldown (occurrences skipped) after repeated failed probes.
    probe_cooldown_max: int = 64
    #: This many capacity flushes ...
    fallback_flushes: int = 3
    #: ... within this many occurrences trigger the fallback to ordinary batching.
    fallback_interval: int = 16

    def __post_init__(self) -> None:
        for name in (
            "unsafe_expiry",
            "estimate_history",
            "bandwidth_history",
            "probe_cooldown_max",
            "fallback_flushes",
            "fallback_interval",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ControllerConfig.{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.short_occurrence_cap, bool):
            raise ValueError(
                f"ControllerConfig.short_occurrence_cap must be True or False, got "
                f"{self.short_occurrence_cap!r}"
            )
        fraction, margin = self.converged_fraction, self.estimate_margin
        if not (_is_real(fraction) and 0.0 <= fraction < 1.0):
            raise ValueError(
                f"ControllerConfig.converged_fraction must be in [0, 1), got {fraction!r}; "
                f"0 bisects down to a single byte, 0.25 stops within 25% of the capacity"
            )
        if not (_is_real(margin) and 0.0 < margin <= 1.0):
            raise ValueError(f"ControllerConfig.estimate_margin must be in (0, 1], got {margin!r}")
        quantile = self.estimate_quantile
        if not (_is_real(quantile) and 0.0 <= quantile <= 1.0):
            raise ValueError(
                f"ControllerConfig.estimate_quantile must be in [0, 1], got {quantile!r}; "
                f"0 budgets for the shortest recent window, 1 for the longest"
            )


@dataclass(frozen=True)
class Grant:
    """The answer to a window OPEN: copy the first ``records`` ready records."""

    version: int
    occurrence: int
    position: int
    #: The bytes the controller allows in this window (never more than staging).
    budget: int
    #: How many of the ready records, from the front, to copy; 0 means copy nothing.
    records: int
    #: Their total size: what the engine copies.
    nbytes: int
    #: The first record alone exceeded the budget and is sent anyway.
    probe: bool
    reason: GrantReason
    #: Bumped by suspend() and resume(): a grant that straddles one is no evidence.
    epoch: int


@dataclass(frozen=True)
class WindowEvidence:
    """A snapshot of what the controller knows about one window position."""

    safe_bytes: int | None
    unsafe_bytes: int | None
    #: The first occurrence at which ``unsafe_bytes`` is forgotten; None without B.
    unsafe_expires_at: int | None
    estimate_bytes: int | None
    failed_probes: int
    #: The first occurrence at which a probe may be granted again.
    probe_allowed_from: int


@dataclass
class _Window:
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


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _nonneg_int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {value!r}")
    return value


class GrantController:
    """Learns, per window position, how many bytes a recurring window can carry.

    Args:
        staging_bytes: size of the pinned staging ring; no grant exceeds it.
        config: tuning knobs (:class:`ControllerConfig`).
    """

    def __init__(self, staging_bytes: int, config: ControllerConfig | None = None) -> None:
        if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int):
            raise ValueError(f"staging_bytes must be an integer, got {staging_bytes!r}")
        if staging_bytes < 1:
            raise ValueError(f"staging_bytes must be >= 1, got {staging_bytes}")
        self._staging = staging_bytes
        self._config = config if config is not None else ControllerConfig()
        self._versions = PatternVersions()
        self._windows: list[_Window] = []
        self._now = 0  # latest occurrence seen: the controller's only clock
        self._suspended = False
        self._epoch = 0
        self._capacity_flushes: deque[int] = deque()
        self._fallback_reason: str | None = None
        self._counts: Counter[str] = Counter()
        self._bandwidths: deque[float] = deque()  # bytes/s of the latest clean transfers

    # -- state ---------------------------------------------------------------------

    @property
    def staging_bytes(self) -> int:
        return self._staging

    @property
    def config(self) -> ControllerConfig:
        return self._config

    @property
    def version(self) -> int:
        """The current pattern version (0 before any pattern)."""
        return self._versions.version

    @property
    def pattern(self) -> WindowPattern | None:
        return self._versions.pattern

    @property
    def suspended(self) -> bool:
        return self._suspended

    @property
    def fallback(self) -> bool:
        """True once the controller gave up on windows (terminal)."""
        return self._fallback_reason is not None

    @property
    def fallback_reason(self) -> str | None:
        return self._fallback_reason

    def counts(self) -> dict[str, int]:
        """Grants by reason, completions by outcome and flushes by kind, e.g.
        ``completion/issued_late``: what the controller did not learn from, too."""
        return dict(self._counts)

    def evidence(self, position: int) -> WindowEvidence:
        w = self._window(position)
        expires = None if w.unsafe is None else w.unsafe_at + self._config.unsafe_expiry
        return WindowEvidence(
            safe_bytes=w.safe,
            unsafe_bytes=w.unsafe,
            unsafe_expires_at=expires,
            estimate_bytes=w.estimate,
            failed_probes=w.failed_probes,
            probe_allowed_from=w.probe_allowed_from,
        )

    def budget(self, position: int) -> int:
        """The bytes window ``position`` may carry at its next OPEN (before records)."""
        return self._budget(self._window(position))[0]

    # -- the engine's calls --------------------------------------------------------

    def define_pattern(self, pattern: WindowPattern) -> int:
        """Make ``pattern`` current and return its version (for the boundary word).

        A new pattern starts learning from scratch: its windows were never measured.
        The capacity-flush history restarts too, since it is kept in occurrences of the
        pattern. A fallback, being terminal, stays.
        """
        before = self._versions.version
        version = self._versions.define(pattern)
        if version != before:
            self._windows = [_Window() for _ in range(len(pattern))]
            self._capacity_flushes.clear()
            self._now = 0
        return version

    def grant(
        self,
        position: int,
        occurrence: int,
        ready: Iterable[int],
        window_s: float | None = None,
    ) -> Grant:
        """A window OPENs: how much of the ready records may it carry?

        Args:
            position: the window position (index into ``pattern.windows``).
            occurrence: the occurrence of the pattern this window belongs to.
            ready: sizes in bytes of the ready whole records, in drain order. Only the
                granted prefix (plus one record) is read.
            window_s: this position's duration in its previous occurrence (device
                timeline), if known: a probe it rules out is not sent.
        """
        w = self._window(position)
        self._advance(_nonneg_int(occurrence, "occurrence"))
        if window_s is not None:
            _check_duration(window_s)
            w.durations.append(window_s)
            if len(w.durations) > self._config.estimate_history:
                w.durations.popleft()
        if self._fallback_reason is not None or self._suspended:
            reason = GrantReason.FALLBACK if self._fallback_reason else GrantReason.SUSPENDED
            return self._make(position, occurrence, self._staging, ready, reason)
        budget, reason = self._budget(w)
        sizes = iter(ready)
        first = next(sizes, None)
        if first is None:
            return self._make(position, occurrence, budget, (), GrantReason.NOTHING_READY)
        first = _nonneg_int(first, "a ready record size")
        if first > self._staging:
            # Never granted: the engine sends it by an oversized flush, which bypasses
            # the staging ring and never counts towards fallback.
            return self._make(position, occurrence, budget, (), GrantReason.OVERSIZED)
        if first > budget:
            if occurrence < w.probe_allowed_from:
                return self._make(position, occurrence, budget, (), GrantReason.COOLDOWN)
            if self._too_short(first, window_s):
                return self._make(position, occurrence, budget, (), GrantReason.TOO_SHORT)
            return self._grant(position, occurrence, budget, 1, first, GrantReason.PROBE)
        return self._make(position, occurrence, budget, _chain(first, sizes), reason)

    def _too_short(self, nbytes: int, window_s: float | None) -> bool:
        """Would ``nbytes`` at the recent bandwidth outlast a window of ``window_s``?"""
        if window_s is None or not self._bandwidths:
            return False
        return window_s * self._bandwidth() < nbytes

    def _bandwidth(self) -> float:
        """Bytes/s of the recent clean transfers (their median); callers check any."""
        return statistics.median(self._bandwidths)

    def complete(
        self,
        grant: Grant,
        *,
        before_close: bool,
        issued_late: bool = False,
        close_late: bool = False,
        transfer_s: float | None = None,
        window_s: float | None = None,
    ) -> Outcome:
        """The transfer made under ``grant`` completed; learn from it if it is clean.

        Args:
            grant: the grant the transfer was issued under.
            before_close: it completed before the window's CLOSE (device timeline).
            issued_late: it was issued late, after a drain stall.
            close_late: the CLOSE was observed late, so ``before_close`` may be wrong.
            transfer_s: device duration of the copy, for E (optional).
            window_s: device duration of the window, OPEN to CLOSE, for E (optional).
        """
        if grant.records == 0:
            raise ValueError(
                f"complete() got a grant with no records ({grant.reason.value}): nothing "
                f"was issued under it, so there is no transfer to report"
            )
        outcome = self._learn(grant, before_close, issued_late, close_late, transfer_s, window_s)
        self._counts[f"completion/{outcome.value}"] += 1
        return outcome

    def flush(self, kind: FlushKind | str, occurrence: int) -> bool:
        """The engine drained outside a window; returns :attr:`fallback` afterwards."""
        try:
            kind = FlushKind(kind)
        except ValueError:
            raise ValueError(
                f"flush kind {kind!r}: expected one of "
                f"{', '.join(k.value for k in FlushKind)} (a FlushKind)"
            ) from None
        self._advance(_nonneg_int(occurrence, "occurrence"))
        self._counts[f"flush/{kind.value}"] += 1
        if kind is not FlushKind.CAPACITY:
            return self.fallback
        if self._suspended or self._fallback_reason is not None or self.pattern is None:
            # Not a verdict on the windows: none were in use.
            self._counts["flush/capacity_not_counted"] += 1
            return self.fallback
        cfg = self._config
        flushes = self._capacity_flushes
        flushes.append(occurrence)
        while flushes and self._now - flushes[0] >= cfg.fallback_interval:
            flushes.popleft()  # isolated flushes age out
        if len(flushes) >= cfg.fallback_flushes:
            self._fallback_reason = (
                f"{len(flushes)} capacity flushes within {cfg.fallback_interval} "
                f"occurrences (at occurrences {', '.join(map(str, flushes))}): the windows "
                f"cannot carry the capture volume, so the engine drains by ordinary "
                f"batching from now on"
            )
        return self.fallback

    def suspend(self) -> None:
        """Enter a phase without windows (evaluation): nothing in it counts."""
        if self._suspended:
            raise RuntimeError(
                "suspend() called while suspended; pair each suspend() with resume()"
            )
        self._suspended = True
        self._epoch += 1

    def resume(self) -> None:
        """Leave the phase entered by :meth:`suspend`."""
        if not self._suspended:
            raise RuntimeError("resume() called while not suspended; call suspend() first")
        self._suspended = False
        self._epoch += 1

    # -- internals -----------------------------------------------------------------

    def _window(self, position: int) -> _Window:
        if self.pattern is None:
            raise RuntimeError(
                "the controller has no window pattern; call "
                "define_pattern(WindowPattern(...)) first"
            )
        if (
            isinstance(position, bool)
            or not isinstance(position, int)
            or not 0 <= position < len(self._windows)
        ):
            raise ValueError(
                f"window position {position!r} out of range: the pattern has "
                f"{len(self._windows)} window(s), positions 0..{len(self._windows) - 1}"
            )
        return self._windows[position]

    def _advance(self, occurrence: int) -> None:
        """Move the clock forward (never back: reports may arrive out of order)."""
        if occurrence <= self._now:
            return
        self._now = occurrence
        expiry = self._config.unsafe_expiry
        for w in self._windows:
            if w.unsafe is not None and occurrence - w.unsafe_at >= expiry:
                w.unsafe = None

    def _budget(self, w: _Window) -> tuple[int, GrantReason]:
        a, b, e = w.safe, w.unsafe, w.estimate
        if a is None and b is None:
            budget, reason = self._staging, GrantReason.NO_EVIDENCE
        elif a is None:
            budget, reason = b // 2, GrantReason.HALVE
        elif b is None:
            if e is not None and e > a:
                budget, reason = e, GrantReason.ESTIMATE
            else:
                budget, reason = a, GrantReason.SAFE
        elif b - a <= self._config.converged_fraction * b:
            budget, reason = a, GrantReason.CONVERGED
        else:
            budget, reason = (a + b) // 2, GrantReason.MIDPOINT
        budget = min(budget, self._staging)
        cap = self._short_occurrences_cap(w)
        if cap is not None and cap < budget:
            return cap, GrantReason.SHORT_OCCURRENCES
        return budget, reason

    def _short_occurrences_cap(self, w: _Window) -> int | None:
        """What the window's short recent occurrences can carry (module docstring)."""
        if not (self._config.short_occurrence_cap and w.durations and self._bandwidths):
            return None
        config = self._config
        short = _low_quantile(w.durations, config.estimate_quantile)
        return round(short * self._bandwidth() * config.estimate_margin)

    def _make(
        self,
        position: int,
        occurrence: int,
        budget: int,
        ready: Iterable[int],
        reason: GrantReason,
    ) -> Grant:
        """A grant of the largest prefix of ``ready`` whose total is at most ``budget``."""
        records = nbytes = 0
        for size in ready:
            size = _nonneg_int(size, "a ready record size")
            if nbytes + size > budget:
                break
            records += 1
            nbytes += size
        return self._grant(position, occurrence, budget, records, nbytes, reason)

    def _grant(
        self,
        position: int,
        occurrence: int,
        budget: int,
        records: int,
        nbytes: int,
        reason: GrantReason,
    ) -> Grant:
        """The grant, counted by reason (a probe sends its first record past the budget)."""
        self._counts[f"grant/{reason.value}"] += 1
        return Grant(
            version=self.version,
            occurrence=occurrence,
            position=position,
            budget=budget,
            records=records,
            nbytes=nbytes,
            probe=reason is GrantReason.PROBE,
            reason=reason,
            epoch=self._epoch,
        )

    def _learn(
        self,
        grant: Grant,
        before_close: bool,
        issued_late: bool,
        close_late: bool,
        transfer_s: float | None,
        window_s: float | None,
    ) -> Outcome:
        # The order matters only for which counter an unusable completion lands in.
        if grant.version != self.version:
            return Outcome.STALE_VERSION
        if self._suspended:
            return Outcome.SUSPENDED
        if grant.epoch != self._epoch:
            return Outcome.INTERRUPTED
        if self._fallback_reason is not None:
            return Outcome.FALLBACK
        # A late issue shortens the window the transfer had; a late CLOSE observation
        # can make an overrun look like a success. Either way the transfer says nothing
        # about the window's capacity, in either direction, and nothing about its timing.
        if issued_late:
            return Outcome.ISSUED_LATE
        if close_late:
            return Outcome.CLOSE_LATE

        w = self._window(grant.position)
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
            self._estimate(w, x, transfer_s, window_s)
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
            skip = min(2 ** (w.failed_probes - 1), self._config.probe_cooldown_max)
            w.probe_allowed_from = grant.occurrence + 1 + skip
        self._estimate(w, x, transfer_s, window_s)
        return outcome

    def _estimate(
        self, w: _Window, nbytes: int, transfer_s: float | None, window_s: float | None
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
            raise ValueError(
                f"transfer_s and window_s must be >= 0, got {transfer_s!r}, {window_s!r}"
            )
        if transfer_s == 0 or nbytes == 0:
            return  # no bandwidth to measure
        config = self._config
        self._bandwidths.append(nbytes / transfer_s)
        while len(self._bandwidths) > config.bandwidth_history:
            self._bandwidths.popleft()
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
    if not (_is_real(window_s) and math.isfinite(window_s) and window_s >= 0):  # type: ignore[arg-type]
        raise ValueError(f"window_s must be a finite number >= 0, got {window_s!r}")


def _chain(first: int, rest: Iterable[int]) -> Iterable[int]:
    yield first
    yield from rest
