"""What the grant controller and the capture engine say to each other.

The values that cross between them: a :class:`Grant` (and its :class:`GrantReason`)
answers a window OPEN, an :class:`Outcome` says what the controller made of a
completion, a :class:`FlushKind` says why the engine drained outside a window, and a
:class:`WindowEvidence` is a snapshot of what the controller knows about one window
position. They live apart from :mod:`syncless.capture.controller.grants` so that the
engine's copy and drain code can name them without the learning rules; all of them are
re-exported by the package, :mod:`syncless.capture.controller`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

__all__ = ["FlushKind", "Grant", "GrantReason", "Outcome", "WindowEvidence"]


class GrantReason(str, Enum):
    """Why a grant is what it is."""

    NO_EVIDENCE = "no_evidence"  # neither A nor B: everything transferable
    HALVE = "halve"  # only B: B / 2
    MIDPOINT = "midpoint"  # A < B, bracket still wide
    CONVERGED = "converged"  # A < B, bracket narrow: A
    SAFE = "safe"  # only A, E not larger: A
    ESTIMATE = "estimate"  # only A, E larger: E
    SHORT_OCCURRENCES = "short_occurrences"  # the evidence's budget, capped by timing
    # for the window's short recent occurrences (see syncless.capture.controller.learning)
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
