"""Thin torch.distributed wrappers shared by the profiler and its ``off`` stand-in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from syncless.hot_path import hot_path


class CollectiveWrappers:
    """``all_reduce`` & co. routed through ``self.collective`` (group defaults to the
    profiler's)."""

    group: dist.ProcessGroup | None = None

    def collective(
        self, name: str, fn: Callable[..., Any], *args: Any, rendezvous: bool = True, **kw: Any
    ) -> Any:
        raise NotImplementedError

    @hot_path
    def all_reduce(
        self, tensor: torch.Tensor, *args: Any, name: str = "all_reduce",
        rendezvous: bool = True, **kw: Any,
    ) -> Any:  # fmt: skip
        """``dist.all_reduce`` through ``collective``."""
        kw.setdefault("group", self.group)
        return self.collective(name, dist.all_reduce, tensor, *args, rendezvous=rendezvous, **kw)

    @hot_path
    def all_to_all_single(
        self, output: torch.Tensor, input: torch.Tensor, *args: Any, name: str = "all_to_all",
        rendezvous: bool = True, **kw: Any,
    ) -> Any:  # fmt: skip
        """``dist.all_to_all_single`` through ``collective``."""
        kw.setdefault("group", self.group)
        return self.collective(
            name, dist.all_to_all_single, output, input, *args, rendezvous=rendezvous, **kw
        )

    @hot_path
    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, *args: Any, name: str = "all_gather",
        rendezvous: bool = True, **kw: Any,
    ) -> Any:  # fmt: skip
        """``dist.all_gather_into_tensor`` through ``collective``."""
        kw.setdefault("group", self.group)
        return self.collective(
            name, dist.all_gather_into_tensor, output, input, *args, rendezvous=rendezvous, **kw
        )
