"""The grant controller's tuning knobs, :class:`ControllerConfig`, and their checks.

What each knob does is in the modules that use it:
:mod:`syncless.capture.controller.learning` (A, B, E, the budget and the short-occurrence
cap), :mod:`syncless.capture.controller.grants` (probes and their cooldown) and
:mod:`syncless.capture.controller.fallback` (the fallback to ordinary batching).
Re-exported by :mod:`syncless.capture.controller`.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ControllerConfig", "is_real"]


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
    #: (syncless.capture.controller.learning); False: the evidence rules alone.
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
        if not (is_real(fraction) and 0.0 <= fraction < 1.0):
            raise ValueError(
                f"ControllerConfig.converged_fraction must be in [0, 1), got {fraction!r}; "
                f"0 bisects down to a single byte, 0.25 stops within 25% of the capacity"
            )
        if not (is_real(margin) and 0.0 < margin <= 1.0):
            raise ValueError(f"ControllerConfig.estimate_margin must be in (0, 1], got {margin!r}")
        quantile = self.estimate_quantile
        if not (is_real(quantile) and 0.0 <= quantile <= 1.0):
            raise ValueError(
                f"ControllerConfig.estimate_quantile must be in [0, 1], got {quantile!r}; "
                f"0 budgets for the shortest recent window, 1 for the longest"
            )


def is_real(value: object) -> bool:
    """An int or a float, and not a bool (which Python counts as an int)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
