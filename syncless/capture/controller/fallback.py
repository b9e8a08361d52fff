"""When the grant controller gives up on windows: repeated capacity flushes.

Fallback
    A capacity flush is the engine draining outside the windows because its ring filled
    up. ``fallback_flushes`` of them within ``fallback_interval`` occurrences (while
    windows are active) mean the windows cannot carry the capture volume: the controller
    falls back to ordinary batching for good (``fallback`` and ``fallback_reason``).
    Isolated ones age out; lifecycle flushes (close) and oversized-record flushes never
    count, and neither does anything while suspended.

:class:`~syncless.capture.controller.GrantController` decides which flushes count (it
knows whether windows are active) and keeps the verdict; :class:`CapacityFlushes`
keeps the recent ones and says when they add up to a fallback.
"""

from __future__ import annotations

from collections import deque

from syncless.capture.controller.config import ControllerConfig

__all__ = ["CapacityFlushes"]


class CapacityFlushes:
    """The occurrences of the recent counted capacity flushes."""

    def __init__(self, config: ControllerConfig) -> None:
        self._config = config
        self._flushes: deque[int] = deque()

    def clear(self) -> None:
        """Forget them all: they are kept in occurrences of a pattern that is gone."""
        self._flushes.clear()

    def add(self, occurrence: int, now: int) -> str | None:
        """Count a capacity flush at ``occurrence`` (``now``: the latest occurrence seen);
        returns why the controller must fall back, or None while it need not."""
        cfg = self._config
        flushes = self._flushes
        flushes.append(occurrence)
        while flushes and now - flushes[0] >= cfg.fallback_interval:
            flushes.popleft()  # isolated flushes age out
        if len(flushes) >= cfg.fallback_flushes:
            return (
                f"{len(flushes)} capacity flushes within {cfg.fallback_interval} "
                f"occurrences (at occurrences {', '.join(map(str, flushes))}): the windows "
                f"cannot carry the capture volume, so the engine drains by ordinary "
                f"batching from now on"
            )
        return None
