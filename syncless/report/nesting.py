"""Section parents from the profiler's nesting records (torch-free).

Since the profiler records ``profile/<name>/depth_count`` and ``order_count`` per
report window (``docs/profile.md``, Records), a reader recovers the section tree
without relying on the order records were stored in: a row's parent is the row one
level up (depth - 1) with the largest order below its own. Depth 0 is the step itself
and the sections directly inside it: their parent is ``None`` (the whole step).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = ["parents", "positions"]

_RECORD = re.compile(r"profile/([^/]+)/(depth|order)_count")


def positions(values: Mapping[str, float]) -> dict[str, tuple[int, int]]:
    """``{name: (depth, order)}`` from one window's ``{metric name: value}``.

    Names with only one of the two records are left out; an empty result means the
    run was recorded before the profiler wrote its nesting.
    """
    found: dict[str, dict[str, int]] = {}
    for metric, value in values.items():
        match = _RECORD.fullmatch(metric)
        if match:
            found.setdefault(match.group(1), {})[match.group(2)] = round(value)
    return {n: (f["depth"], f["order"]) for n, f in found.items() if len(f) == 2}


def parents(where: Mapping[str, tuple[float, float]]) -> dict[str, str | None]:
    """``{name: (depth, order)}`` -> ``{name: parent}``; ``None`` at depth 0.

    The parent is the name at depth - 1 with the largest order below the name's own
    (depth-first order puts a parent before its children, and its later siblings after
    its last descendant). A name with no such row (inconsistent records) gets ``None``.
    """
    ranked = sorted(where.items(), key=lambda kv: kv[1][1])
    last_at: dict[int, str] = {}  # depth -> the latest name seen at that depth
    out: dict[str, str | None] = {}
    for name, (depth, _) in ranked:
        d = round(depth)
        out[name] = last_at.get(d - 1) if d > 0 else None
        last_at[d] = name
        for deeper in [k for k in last_at if k > d]:  # a new subtree starts here
            del last_at[deeper]
    return out
