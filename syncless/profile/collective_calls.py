"""``all_reduce`` and co. routed through a profiler's ``collective``: defined once here,
and the same methods of :class:`~syncless.profile.Profiler` and its ``off`` stand-in
(each class binds them: ``all_reduce = collective_calls.all_reduce``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from syncless.hot_path import hot_path

__all__ = ["all_gather_into_tensor", "all_reduce", "all_to_all_single"]


class Collectives(Protocol):
    """What the calls need of the profiler: its group and its ``collective``."""

    group: dist.ProcessGroup | None

    def collective(
        self, name: str, fn: Callable[..., Any], *args: Any, rendezvous: bool = True, **kw: Any
    ) -> Any: ...


@hot_path
def all_reduce(
    self: Collectives, tensor: torch.Tensor, *args: Any, name: str = "all_reduce",
    rendezvous: bool = True, **kw: Any,
) -> Any:  # fmt: skip
    """``dist.all_reduce`` through ``collective`` (the group defaults to the profiler's)."""
    kw.setdefault("group", self.group)
    return self.collective(name, dist.all_reduce, tensor, *args, rendezvous=rendezvous, **kw)


@hot_path
def all_to_all_single(
    self: Collectives, output: torch.Tensor, input: torch.Tensor, *args: Any,
    name: str = "all_to_all", rendezvous: bool = True, **kw: Any,
) -> Any:  # fmt: skip
    """``dist.all_to_all_single`` through ``collective``."""
    kw.setdefault("group", self.group)
    return self.collective(
        name, dist.all_to_all_single, output, input, *args, rendezvous=rendezvous, **kw
    )


@hot_path
def all_gather_into_tensor(
    self: Collectives, output: torch.Tensor, input: torch.Tensor, *args: Any,
    name: str = "all_gather", rendezvous: bool = True, **kw: Any,
) -> Any:  # fmt: skip
    """``dist.all_gather_into_tensor`` through ``collective``."""
    kw.setdefault("group", self.group)
    return self.collective(
        name, dist.all_gather_into_tensor, output, input, *args, rendezvous=rendezvous, **kw
    )
