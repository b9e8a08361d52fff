"""Leaving the guard leaves torch exactly as it was, also after errors and misuse."""

from __future__ import annotations

import pytest
import torch

from syncless.guard import SyncError, _bridge, census, no_sync


def _stacks() -> tuple[int, int]:
    return torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()


def test_modes_are_removed_after_a_normal_exit() -> None:
    before = _stacks()
    engine = getattr(torch.autograd, "_engine_run_backward", None)
    with no_sync(cpu_as_device=True):
        assert _stacks() == (before[0] + 1, before[1] + 1)
        assert torch._C._is_torch_function_mode_enabled()
        if _bridge.available():
            assert torch.autograd._engine_run_backward is not engine
    assert _stacks() == before
    assert not torch._C._is_torch_function_mode_enabled()
    assert getattr(torch.autograd, "_engine_run_backward", None) is engine
    assert torch.ones(2).sum().item() == 2.0  # no guard left to raise


def test_modes_are_removed_when_the_block_raises() -> None:
    before = _stacks()
    with pytest.raises(SyncError), no_sync(cpu_as_device=True):
        torch.ones(2).tolist()
    assert _stacks() == before
    with pytest.raises(KeyError), no_sync(cpu_as_device=True):
        raise KeyError("unrelated")
    assert _stacks() == before
    assert torch.ones(2).tolist() == [1.0, 1.0]


def test_nested_guards_share_one_pair_of_modes() -> None:
    before = _stacks()
    guard = no_sync(cpu_as_device=True)
    with guard, census(cpu_as_device=True), guard:
        assert _stacks() == (before[0] + 1, before[1] + 1)
        with pytest.raises(SyncError):
            torch.ones(1).item()
    assert _stacks() == before


def test_exiting_out_of_order_is_an_error_and_still_cleans_up() -> None:
    before = _stacks()
    guard, counter = no_sync(cpu_as_device=True), census(cpu_as_device=True)
    guard.__enter__()
    counter.__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        guard.__exit__(None, None, None)
    torch.ones(1).item()  # the guard's frame is gone; only the census remains
    counter.__exit__(None, None, None)
    assert counter.total == 1
    assert _stacks() == before


def test_a_foreign_mode_left_open_is_reported() -> None:
    from torch.overrides import TorchFunctionMode

    class Passthrough(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    foreign = Passthrough()
    before = _stacks()
    guard = no_sync(cpu_as_device=True)
    guard.__enter__()
    foreign.__enter__()
    with pytest.raises(RuntimeError, match="still active"):
        guard.__exit__(None, None, None)
    foreign.__exit__(None, None, None)
    # Our mode stayed behind, inert: nothing raises, and a new guard still works.
    assert torch.ones(1).item() == 1.0
    with no_sync(cpu_as_device=True), pytest.raises(SyncError):
        torch.ones(1).item()
    # Clean up the way the guard would have: its own modes' __exit__, dispatch first.
    torch._C._get_dispatch_stack_at(_stacks()[1] - 1).__exit__(None, None, None)
    torch._C._get_function_stack_at(_stacks()[0] - 1).__exit__(None, None, None)
    assert _stacks() == before
