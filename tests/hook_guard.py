"""``HookGuard``: run the hooks a test's attach added under ``no_sync()``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from syncless.guard import no_sync

# Every per-module hook dict torch keeps; the *_with_kwargs / always_called dicts are
# keyed by the same handle ids and emptied by handle.remove() too.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def hook_keys(model: nn.Module) -> set[tuple[int, str, int]]:
    """(module id, dict name, handle id) of every hook on every module of ``model``."""
    return {
        (id(m), name, hid)
        for m in model.modules()
        for name in _HOOK_DICTS
        for hid in getattr(m, name)
    }


def optimizer_hook_ids(optimizer: torch.optim.Optimizer) -> set[int]:
    """The ids of the optimizer's step hooks now."""
    return {*optimizer._optimizer_step_pre_hooks, *optimizer._optimizer_step_post_hooks}


class HookGuard:
    """Runs every hook installed after :meth:`snapshot` under ``no_sync(cpu_as_device=True)``.

    The models' own forwards may sync (the demo reads expert counts back, HF MoE
    dispatch uses data-dependent indexing), so the guard wraps the adapters' hooks
    themselves rather than the whole forward: a sync inside one raises SyncError.
    """

    def __init__(self) -> None:
        self.calls = 0
        self._before: set[tuple[int, str, int]] = set()

    def snapshot(self, model: nn.Module) -> None:
        self._before = hook_keys(model)

    def guard(self, model: nn.Module) -> int:
        """Wrap the hooks added since the snapshot; returns how many were wrapped."""
        wrapped = 0
        for m in model.modules():
            for name in ("_forward_hooks", "_forward_pre_hooks"):
                hooks = getattr(m, name)
                for hid, fn in list(hooks.items()):
                    if (id(m), name, hid) not in self._before:
                        hooks[hid] = self._wrap(fn)
                        wrapped += 1
        return wrapped

    def guard_optimizer(self, optimizer: torch.optim.Optimizer, before: set[int]) -> int:
        """Wrap the optimizer step hooks whose ids are not in ``before`` (taken before
        attach: ``optimizer_hook_ids``); returns how many were wrapped."""
        wrapped = 0
        for hooks in (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks):
            for hid, fn in list(hooks.items()):
                if hid not in before:
                    hooks[hid] = self._wrap(fn)
                    wrapped += 1
        return wrapped

    def added(self, model: nn.Module) -> set[tuple[int, str, int]]:
        return hook_keys(model) - self._before

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            with no_sync(cpu_as_device=True):
                return fn(*args, **kwargs)

        return guarded
