"""census(): step accounting, records for the run store, the table, nesting."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from syncless.guard import Site, SyncError, census, no_sync
from syncless.guard.counting import BLIND_SPOTS
from syncless.run.records import StepRecord, check_metric_name


def _sync_n(x: torch.Tensor, n: int) -> None:
    for _ in range(n):
        x.tolist()  # SYNC


def test_steps_close_in_order_and_count_separately() -> None:
    x = torch.ones(2)
    plan = [3, 0, 2, 5]
    with census(cpu_as_device=True) as c:
        returned = []
        for n in plan:
            _sync_n(x, n)
            returned.append(c.step())
    assert returned == plan
    assert c.per_step() == {0: 3, 1: 0, 2: 2, 3: 5}
    assert c.total == sum(plan)


def test_explicit_step_numbers_and_start_step() -> None:
    x = torch.ones(2)
    with census(cpu_as_device=True, start_step=100) as c:
        _sync_n(x, 1)
        c.step()  # 100
        _sync_n(x, 2)
        c.step(7)
        _sync_n(x, 4)
        c.step()  # 8: one after the explicit step
    assert c.per_step() == {100: 1, 7: 2, 8: 4}


def test_exit_closes_a_counted_open_step_but_not_an_empty_one() -> None:
    x = torch.ones(2)
    with census(cpu_as_device=True) as counted:
        counted.step()
        _sync_n(x, 2)
    assert counted.per_step() == {0: 0, 1: 2}

    with census(cpu_as_device=True) as trailing:
        _sync_n(x, 1)
        trailing.step()
    assert trailing.per_step() == {0: 1}

    with census(cpu_as_device=True) as silent:
        pass
    assert silent.per_step() == {0: 0}  # "0 syncs" is still a result for one step


def test_records_are_valid_and_match_the_counts(marked_line) -> None:
    x = torch.ones(2)
    with census(cpu_as_device=True) as c:
        _sync_n(x, 2)
        c.step()
        x.sum().item()  # ITEM
        c.step()
    records = c.records("run-a", rank=3)
    assert all(isinstance(r, StepRecord) for r in records)
    for r in records:
        assert check_metric_name(r.name) == r.name
        assert (r.run, r.rank) == ("run-a", 3)
    table = {(r.step, r.name): r.value for r in records}
    loop_key = f"test_census.{marked_line(_sync_n)}._sync_n"
    item_key = f"test_census.{marked_line(test_records_are_valid_and_match_the_counts, '# ITEM')}.test_records_are_valid_and_match_the_counts"
    assert table == {
        (0, "guard/step/syncs_count"): 2.0,
        (0, f"guard/site/{loop_key}/syncs_count"): 2.0,
        (1, "guard/step/syncs_count"): 1.0,
        (1, f"guard/site/{item_key}/syncs_count"): 1.0,
    }


def test_site_metric_key_is_sanitized() -> None:
    site = Site("/nowhere/odd name+file.py", 12, "<lambda>")
    key = site.metric_key()
    assert key == "odd_name_file.12._lambda_"
    assert check_metric_name(f"guard/site/{key}/syncs_count")


def test_by_site_is_most_frequent_first(marked_line) -> None:
    x = torch.ones(2)
    with census(cpu_as_device=True) as c:
        _sync_n(x, 3)
        x.numpy()  # NUMPY
    items = list(c.by_site().items())
    assert [count for _, count in items] == [3, 1]
    assert items[0][0] == (Site(__file__, marked_line(_sync_n), "_sync_n"), "Tensor.tolist")


def test_print_table_lists_sites_and_blind_spots() -> None:
    x = torch.ones(2)
    with census(cpu_as_device=True) as c:
        _sync_n(x, 4)
        c.step()
        c.step()
    buffer = io.StringIO()
    c.print_table(Console(file=buffer, width=200))
    text = buffer.getvalue()
    assert "Tensor.tolist" in text
    assert "_sync_n" in text
    assert " 4 " in text
    assert "2.00" in text  # 4 syncs over 2 steps
    assert "torch.distributed" in text
    assert BLIND_SPOTS.split()[0] in text


def test_census_inside_no_sync_counts_then_the_guard_raises() -> None:
    x = torch.ones(2)
    with no_sync(cpu_as_device=True), census(cpu_as_device=True) as c:  # noqa: SIM117
        with pytest.raises(SyncError):
            x.cpu()
    assert c.by_op() == {"Tensor.cpu": 1}


def test_no_sync_inside_census_counts_too() -> None:
    x = torch.ones(2)
    with census(cpu_as_device=True) as c:
        with no_sync(cpu_as_device=True), pytest.raises(SyncError):
            x.cpu()
        x.cpu()  # counted, not raised: the guard is gone
    assert c.total == 2


def test_nested_censuses_each_count_once() -> None:
    x = torch.ones(2)
    with census(cpu_as_device=True) as outer:
        with census(cpu_as_device=True) as inner:
            x.sum().item()
        x.sum().item()
    assert (outer.total, inner.total) == (2, 1)


def test_a_census_cannot_be_entered_twice_at_once() -> None:
    c = census(cpu_as_device=True)
    with c, pytest.raises(RuntimeError, match="already active"):  # noqa: SIM117
        with c:
            pass
