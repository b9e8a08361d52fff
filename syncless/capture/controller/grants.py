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

Here: those calls, what a grant is made of, and which completions and flushes count.
Elsewhere in :mod:`syncless.capture.controller`, one concept per module: ``types`` (the
values exchanged with the engine: ``Grant``, ``GrantReason``, ``Outcome``, ``FlushKind``,
``WindowEvidence``), ``config`` (``ControllerConfig``, the knobs), ``learning`` (the
evidence per window position, A, B and E, the budget it yields, and learning from clean
transfers) and ``fallback`` (when capacity flushes end the windows). The types and the
config are importable from here too.

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
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from syncless.capture.controller.config import ControllerConfig
from syncless.capture.controller.fallback import CapacityFlushes
from syncless.capture.controller.learning import (
    WindowState,
    forget_expired_unsafe,
    learn_from_transfer,
    median_bandwidth,
    note_duration,
    window_budget,
)
from syncless.capture.controller.types import (
    FlushKind,
    Grant,
    GrantReason,
    Outcome,
    WindowEvidence,
)
from syncless.capture.windows import PatternVersions, WindowPattern

__all__ = ["GrantController"]  # the rest of the controller: its package's __init__


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
        self._windows: list[WindowState] = []
        self._now = 0  # latest occurrence seen: the controller's only clock
        self._suspended = False
        self._epoch = 0
        self._capacity_flushes = CapacityFlushes(self._config)
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
            self._windows = [WindowState() for _ in range(len(pattern))]
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
            note_duration(w, window_s, self._config)
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
        return window_s * median_bandwidth(self._bandwidths) < nbytes

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
        reason = self._capacity_flushes.add(occurrence, self._now)
        if reason is not None:
            self._fallback_reason = reason
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

    def _window(self, position: int) -> WindowState:
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
        forget_expired_unsafe(self._windows, occurrence, self._config)

    def _budget(self, w: WindowState) -> tuple[int, GrantReason]:
        return window_budget(w, self._staging, self._config, self._bandwidths)

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

        return learn_from_transfer(
            self._window(grant.position),
            grant,
            before_close,
            transfer_s,
            window_s,
            self._config,
            self._bandwidths,
        )


def _chain(first: int, rest: Iterable[int]) -> Iterable[int]:
    yield first
    yield from rest
