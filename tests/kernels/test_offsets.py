"""OffsetRing: tables reach the device, an unchanged table is not uploaded again, a
changed one goes to another slot (the last one's readers keep their table)."""

from __future__ import annotations

import torch

from syncless.kernels.offsets import OffsetRing


def test_unchanged_tables_are_not_uploaded_again_and_changes_use_another_slot():
    ring = OffsetRing(torch.device("cpu"), size=4, slots=2)
    first = ring.upload([0, 10, 20, 30])
    assert first is not None and first.tolist() == [0, 10, 20, 30]
    assert ring.upload([0, 10, 20, 30]) is first  # same values: the same tensor
    assert ring.uploads == 1
    second = ring.upload([0, 11, 22, 33])
    assert second is not None and second.tolist() == [0, 11, 22, 33]
    assert second.data_ptr() != first.data_ptr()  # another slot
    assert first.tolist() == [0, 10, 20, 30]  # what earlier readers hold is intact
    third = ring.upload([1, 2, 3, 4])  # two slots: back to the first one
    assert third is not None and third.data_ptr() == first.data_ptr()
    assert third.tolist() == [1, 2, 3, 4] and ring.uploads == 3


def test_a_short_table_uses_a_prefix():
    ring = OffsetRing(torch.device("cpu"), size=6)
    table = ring.upload([5, 6])
    assert table is not None and table.tolist() == [5, 6]
