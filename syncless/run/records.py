"""The unit every syncless subsystem emits: one named number for one step on one rank."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from itertools import repeat
from typing import NamedTuple

# area/scope/name: at least two slash-separated parts of [A-Za-z0-9_.-], e.g.
# `monitors/layer_03/qk_logit_max` or `demo/step/loss`.
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)+$")


class StepRecord(NamedTuple):
    """One value of one metric at one step on one rank.

    ``name`` is ``area/scope/name_unit`` (see ARCHITECTURE.md); ``time`` is the wall
    clock (seconds since the epoch) when the value was produced on the host. A named
    tuple, not a frozen dataclass: monitors emit ~1,500 per step on the training
    thread and a tuple builds in 0.27 us against 0.73 us.
    """

    run: str
    step: int
    rank: int
    name: str
    value: float
    time: float


_new_record = functools.partial(tuple.__new__, StepRecord)


def step_records(
    run: str, step: int, rank: int, names: Iterable[str], values: Iterable[float], time: float
) -> list[StepRecord]:
    """Records of one step and rank, built without a Python frame per record (the
    named tuple's own constructor is one): 0.26 against 0.44 ms for 1,536 on this CPU."""
    fields = zip(repeat(run), repeat(step), repeat(rank), names, values, repeat(time))
    return list(map(_new_record, fields))


def check_metric_name(name: str) -> str:
    """Return ``name`` if it is a valid ``area/scope/name`` metric name, else raise."""
    if not _NAME_RE.match(name):
        raise ValueError(
            f"invalid metric name {name!r}: expected 'area/scope/name_unit' "
            "(slash-separated parts of letters, digits, '_', '.', '-'), "
            "e.g. 'demo/step/loss'"
        )
    return name
