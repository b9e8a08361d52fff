"""LayerBatch's deferred folds: held to the flush, in order, and never without bound."""

from __future__ import annotations

import torch

from syncless.graphs import StandInGraph
from syncless.metrics import MetricSet
from syncless.monitors.layer_batch import MAX_DEFERRED, LayerBatch


class _Group:
    """A SlotGroup stand-in that notes each fold (the kernels are tested elsewhere)."""

    def __init__(self) -> None:
        self.metrics = MetricSet()
        self._folds: list[tuple[torch.Tensor, float]] = []
        self.kernel_gate = None

    def fold(self, partials: torch.Tensor, n_samples: float) -> None:
        self._folds.append((partials.sum(), n_samples))  # read later: no host read here

    @property
    def folds(self) -> list[tuple[float, float]]:
        return [(float(total), n) for total, n in self._folds]


def _batch(group: _Group) -> LayerBatch:
    return LayerBatch(
        [0, 1],
        group,  # type: ignore[arg-type]
        view=lambda x: (x,),
        grouped=lambda x, offsets, n, gate: x.clone(),
        single=lambda layer, x: None,
        device=torch.device("cpu"),
        samples=lambda x: float(x.shape[0]),
        defer_fold=True,
    )


def test_deferred_folds_land_at_the_flush_in_order():
    group = _Group()
    batch = _batch(group)
    storage = torch.zeros(2, 3, 4)
    for forward in range(3):
        storage.fill_(forward + 1)
        batch.add(0, storage[0])
        batch.add(1, storage[1])  # the set is complete: one grouped "launch"
    assert batch.grouped_launches == 3 and group.folds == []
    group.metrics.before_flush[0]()  # what MetricSet.flush calls first
    # each forward's partials as they were then (a clone), in forward order
    assert group.folds == [(12.0 * (f + 1), 3.0) for f in range(3)]


def test_a_loop_that_never_flushes_folds_past_the_cap():
    group = _Group()
    batch = _batch(group)
    storage = torch.ones(2, 3, 4)
    for _ in range(MAX_DEFERRED + 5):
        batch.add(0, storage[0])
        batch.add(1, storage[1])
    assert len(batch._unfolded) == MAX_DEFERRED and len(group.folds) == 5
    batch.finish()
    assert len(group.folds) == MAX_DEFERRED + 5 and batch._unfolded == []


def test_tensors_off_16_byte_alignment_take_the_per_layer_path():
    """The grouped kernels tell the compiler every layer's offset keeps 16-byte
    alignment (vectorized loads); a layer that breaks it must not reach them."""
    group = _Group()
    batch = _batch(group)
    storage = torch.zeros(2 * 12 + 1)  # float32: 4 bytes an element
    aligned = storage[:24].view(2, 3, 4)
    batch.add(0, aligned[0])
    batch.add(1, aligned[1])  # 48 bytes apart: grouped
    assert (batch.grouped_launches, batch.single_launches) == (1, 0)
    shifted = storage[1:].view(2, 3, 4)  # 4 bytes off the first layer's 16-byte grid
    batch.add(0, aligned[0])
    batch.add(1, shifted[1])
    assert (batch.grouped_launches, batch.single_launches) == (1, 2)


def test_a_capture_that_ends_before_the_last_layer_is_dropped_and_reported():
    """A graph per layer: the first layer's tensor was added during a capture that ended
    before the second layer's. Launched at the flush, it would be read once, outside the
    graph: it is dropped, and the handle gets an error saying what to do."""
    group = _Group()
    batch = _batch(group)
    storage = torch.ones(2, 3, 4)
    graph = StandInGraph()
    with graph.capture():
        batch.add(0, storage[0])
    batch.finish()
    assert group.folds == [] and batch.grouped_launches == 0
    error = batch.take_error()
    assert error is not None and "launch='layer'" in str(error)
    assert batch.take_error() is None and batch.dropped_captured == 1


def test_inside_a_capture_the_fold_is_not_deferred():
    """A fold left to the flush would run once, outside the graph: inside a capture the
    grouped launch folds at once (and so at every replay)."""
    group = _Group()
    batch = _batch(group)
    storage = torch.ones(2, 3, 4)
    graph = StandInGraph()
    with graph.capture():
        batch.add(0, storage[0])
        batch.add(1, storage[1])
    assert batch.grouped_launches == 1 and len(group.folds) == 1 and batch._unfolded == []
