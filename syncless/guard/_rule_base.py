"""What every sync rule is made of: ``OpInfo``, ``Rule`` and the predicate parts.

A rule pairs an :class:`OpInfo` (a stable name, what the user wrote, how to avoid
it) with a predicate over the call's arguments. The predicates share one question,
:func:`on_device` (is this tensor's data on a device, or treated as such in the CPU
simulation), an argument lookup and the hint texts both rule tables give.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class OpInfo:
    """A detectable operation: stable name, what the user wrote, how to avoid it."""

    name: str
    what: str
    hint: str


# (args, kwargs, cpu_as_device) -> would this call sync?
Predicate = Callable[[tuple[Any, ...], Mapping[str, Any], bool], bool]


@dataclass(frozen=True, slots=True)
class Rule:
    info: OpInfo
    applies: Predicate


def on_device(value: object, cpu_as_device: bool) -> bool:
    """True when ``value`` is a tensor whose data lives (or is treated as living) on a device."""
    if not isinstance(value, torch.Tensor):
        return False
    kind = value.device.type
    if kind == "meta":
        return False
    return cpu_as_device if kind == "cpu" else True


def _self_on_device(args: tuple[Any, ...], kwargs: Mapping[str, Any], cpu_as_device: bool) -> bool:
    return bool(args) and on_device(args[0], cpu_as_device)


def _always(args: tuple[Any, ...], kwargs: Mapping[str, Any], cpu_as_device: bool) -> bool:
    return True


def _arg(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], pos: int, name: str, default: Any
) -> Any:
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name, default)


_HOST_COPY_HINT = (
    "keep the tensor on the device; to read it, copy it into a pinned host buffer with "
    "buf.copy_(x, non_blocking=True) (or x.to('cpu', non_blocking=True)) and read the "
    "buffer after the step's one synchronization point"
)
_SCALAR_HINT = (
    "keep the value on the device as a 0-dim tensor (accumulate into a device buffer) "
    "and read it back once per step in a batched, lagged copy"
)
_BRANCH_HINT = (
    "do not branch in Python on tensor values: use torch.where(cond, a, b), masking or "
    "clamp, and keep the result on the device"
)
_PRINT_HINT = (
    "record the value as a device-side metric (or format it outside the hot path, "
    "after the step's synchronization point)"
)
