"""Section names: sanitised once, when a section is first seen, into metric-safe parts."""

from __future__ import annotations

import re

from syncless.run.records import check_metric_name

CATEGORIES = ("compute", "bandwidth", "launch", "sync", "collective")
COLLECTIVE_PARTS = ("enqueue", "rendezvous", "transfer")

# Scopes the profiler uses for its own rows; a user section with one of these names
# gets a trailing '_' so `profile/step/time_ms` always means the whole step.
RESERVED = frozenset({"step", "self", "calibration"})

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def sanitize(name: str) -> str:
    """``name`` as one metric-name part: characters outside [A-Za-z0-9_.-] become '_'.

    Two names that sanitise to the same string share one row (documented limit).
    """
    if not isinstance(name, str):
        raise TypeError(f"a section name must be a str, got {type(name).__name__}")
    clean = _UNSAFE.sub("_", name) or "_"
    return clean + "_" if clean in RESERVED else clean


def metric(scope: str, name_unit: str) -> str:
    """``profile/<scope>/<name_unit>``, checked against the project's naming rule."""
    return check_metric_name(f"profile/{scope}/{name_unit}")
