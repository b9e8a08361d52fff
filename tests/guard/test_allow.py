"""allow_sync: permits intended syncs inside no_sync(), records them, needs a reason."""

from __future__ import annotations

import pytest
import torch

from syncless.guard import AllowedSync, Site, SyncError, allow_sync, census, no_sync


def _read_loss(loss: torch.Tensor) -> float:
    return loss.item()  # SYNC


def test_allowed_sync_runs_and_is_recorded(marked_line) -> None:
    loss = torch.tensor(2.5)
    with no_sync(cpu_as_device=True) as guard:
        with allow_sync("log the loss once per step"):
            value = _read_loss(loss)
        assert value == 2.5
    site = Site(__file__, marked_line(_read_loss), "_read_loss")
    assert guard.allowed == [AllowedSync("log the loss once per step", "Tensor.item", site)]


def test_allow_ends_with_its_block() -> None:
    x = torch.ones(2)
    with no_sync(cpu_as_device=True) as guard:
        with allow_sync("setup"):
            x.tolist()
        with pytest.raises(SyncError, match=r"Tensor\.tolist"):
            x.tolist()
    assert [a.op for a in guard.allowed] == ["Tensor.tolist"]


@pytest.mark.parametrize("reason", ["", "   ", "\n\t"])
def test_reason_is_required(reason: str) -> None:
    with no_sync(cpu_as_device=True), pytest.raises(ValueError, match="needs a reason"):  # noqa: SIM117
        with allow_sync(reason):
            pass


def test_reason_must_be_text() -> None:
    with pytest.raises(ValueError, match="needs a reason"), allow_sync(None):  # type: ignore[arg-type]
        pass


def test_no_sync_inside_allow_forbids_again() -> None:
    x = torch.ones(2)
    with no_sync(cpu_as_device=True) as outer, allow_sync("outer reason"):
        with no_sync(cpu_as_device=True) as inner, pytest.raises(SyncError):
            x.cpu()
        x.cpu()
    assert inner.allowed == []
    assert [(a.reason, a.op) for a in outer.allowed] == [("outer reason", "Tensor.cpu")]


def test_nested_guards_each_record_the_allowed_sync() -> None:
    x = torch.ones(2)
    with no_sync(cpu_as_device=True) as outer, no_sync(cpu_as_device=True) as inner:  # noqa: SIM117
        with allow_sync("both see it"):
            x.numpy()
    assert [a.op for a in outer.allowed] == ["Tensor.numpy"]
    assert [a.op for a in inner.allowed] == ["Tensor.numpy"]


def test_allow_outside_a_guard_is_a_no_op() -> None:
    with allow_sync("nothing to relax"):
        assert torch.ones(2).sum().item() == 2.0


def test_census_still_counts_allowed_syncs() -> None:
    with census(cpu_as_device=True) as c, no_sync(cpu_as_device=True) as guard:  # noqa: SIM117
        with allow_sync("counted anyway"):
            torch.ones(2).tolist()
    assert c.by_op() == {"Tensor.tolist": 1}
    assert len(guard.allowed) == 1
