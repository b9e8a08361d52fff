"""One grouped launch per forward for a monitor's per-layer reads (the default launch).

On a host-bound step every kernel launch is host time: with two Triton launches per
hooked module a hook cost 139-288 us of the H200's host, one grouped launch per
forward brings it to 22-49 us per hooked module, launches included (bench/RESULTS.md,
``monitor_host_cost``, 27552df and 0fae693; the range is two machines). In grouped
mode a hook only keeps a reference to the tensor it would have read. When every
hooked layer has one (the forward passed the last of them), one grouped partials
kernel reads all of them and one fold updates every layer's slots: two launches per
forward instead of two per layer. The tensors held are the layers' outputs of the
current forward, which training keeps for backward anyway; under ``no_grad``
(evaluation) nothing does, so there each layer launches on its own. With activation
checkpointing the outputs are not kept either, and holding them would undo part of
its saving: use ``launch="layer"`` there.

The per-layer path is still taken, layer by layer, when the set is not the whole
model in one forward: a layer seen again before the set is complete (activation
recompute, a second forward), what is pending at flush, tensors whose shape, dtype or
strides differ between layers, or no free offset buffer (``OffsetRing``).

``launch="layer"`` or ``SYNCLESS_MONITOR_LAUNCH=layer`` restores per-layer launches.

Inside a CUDA graph capture the grouped launch is captured as it runs eagerly: the
offsets table is copied once, at capture, into a slot the graph keeps
(``OffsetRing``), and the fold is never deferred (a fold at the flush would run once,
outside the graph, not at every replay). The kernels a capture launches must have
been loaded by an eager step before it (a first launch loads a module, which a capture
refuses): the same path as eagerly, so the warm-up step loads them. A capture that ends
before every layer was seen (a graph per layer) leaves the rest pending: the flush
drops it and says so (use ``launch="layer"`` with per-layer graphs).

``defer_fold=True`` leaves the fold (and ``after``) of a grouped launch to
``finish()``, which every ``MetricSet.flush`` runs first (``before_flush``): the grouped
kernel still reads the
tensors in the forward, but the fold's launches move from the end of the forward,
where a host-bound step's GPU is idle and a launch costs the H200's host 93 us, to the
flush, where the GPU is still busy with backward and the optimizer and a launch costs
37-42 us (bench/RESULTS.md, probe at 839d1b4). A monitor whose slots training may read during the step
(the nonfinite alert) folds at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from syncless.graphs import capturing
from syncless.hot_path import hot_path
from syncless.kernels.offsets import OffsetRing
from syncless.metrics.slot_group import SlotGroup

LAUNCHES = ("layer", "grouped")
#: Deferred folds held at most (each holds one forward's partials until the flush).
MAX_DEFERRED = 16


def launch_mode(launch: str | None) -> str:
    """``launch``, or ``SYNCLESS_MONITOR_LAUNCH`` (default ``grouped``), checked."""
    mode = launch if launch is not None else os.environ.get("SYNCLESS_MONITOR_LAUNCH", "grouped")
    if mode not in LAUNCHES:
        raise ValueError(
            f"monitor launch mode {mode!r} (from launch= or SYNCLESS_MONITOR_LAUNCH): "
            f"expected one of {', '.join(LAUNCHES)}"
        )
    return mode


class LayerBatch:
    """Collects one monitor's per-layer views during a forward and launches them at once.

    A layer's read is one or more tensors (attention: q and k). Offsets are uploaded as
    one table, the first tensor's ``L`` offsets, then the second's, ...

    Args:
        layers: the hooked layer indices, in forward order.
        group: a ``SlotGroup`` whose columns are every layer's columns, layer after
            layer, in the order of ``layers`` (what ``grouped`` writes).
        view: the tensors a kernel reads, from what the hook got (e.g. ``[rows, C]``).
        grouped: ``(*first layer's views, device offsets, n_layers, gate=) -> partials
            [P, L * width]``; ``gate``: the group's ``kernel_gate``, for the kernel to
            return early when it is off (inside a CUDA graph).
        single: ``(layer, *views)``: the per-layer path (partials and that layer's fold).
        accepts: ``(*first layer's views) -> bool``: False rules the grouped kernel out
            for these shapes (e.g. a sampled attention shape): every layer takes
            ``single``.
        after: called with the grouped partials and their ``samples`` after their fold
            (e.g. a value over layers that the fold cannot form, such as a max of
            per-layer sums).
        samples: the samples one layer's read counts for (the fold's ``n_samples``), from
            its views; every layer's views have the same shapes.
    """

    def __init__(
        self,
        layers: list[int],
        group: SlotGroup,
        view: Callable[..., tuple[torch.Tensor, ...]],
        grouped: Callable[..., torch.Tensor],
        single: Callable[..., None],
        device: torch.device,
        accepts: Callable[..., bool] = lambda *views: True,
        after: Callable[[torch.Tensor, float], None] | None = None,
        samples: Callable[..., float] = lambda *views: 1.0,
        tensors: int = 1,
        defer_fold: bool = False,
    ) -> None:
        self.layers = layers
        self.group = group
        self._view, self._grouped, self._single = view, grouped, single
        self._accepts, self._after, self._samples = accepts, after, samples
        self._offsets = OffsetRing(device, tensors * len(layers))
        self._pending: dict[int, tuple[torch.Tensor, ...]] = {}  # raw, as hooks gave them
        self._n_layers = len(layers)
        self._defer = defer_fold
        self._unfolded: list[tuple[torch.Tensor, float]] = []  # (partials, samples)
        self._pending_captured = False  # the pending tensors were added during a capture
        # What is pending or unfolded at a flush is this step's: finish it first.
        group.metrics.before_flush.append(self.finish)
        self.grouped_launches = 0
        self.single_launches = 0
        self.dropped_captured = 0  # layers a capture left pending (finish dropped them)
        self.error: Exception | None = None  # for the handle to report (take_error)

    @hot_path
    def add(self, layer: int, *xs: torch.Tensor) -> None:
        """Keep ``layer``'s tensors; launch when every layer has them.

        Only a reference is kept here: the view and the checks run once per forward,
        at launch, since every torch call (even a ``reshape``) is host time per layer.
        """
        if not torch.is_grad_enabled():
            # No autograd graph keeps these tensors past their layer (an evaluation
            # forward): holding them to the end of the forward would cost memory.
            self._single(layer, *self._view(*xs))
            self.single_launches += 1
            return
        pending = self._pending
        if layer in pending:
            self.launch()
        if not pending:
            self._pending_captured = capturing(xs[0].is_cuda)
        pending[layer] = xs
        if len(pending) == self._n_layers:
            self.launch()

    @hot_path
    def launch(self) -> None:
        """Launch what is pending: grouped if it is every layer and they line up."""
        pending, self._pending = self._pending, {}
        if not pending:
            return
        table = first = None
        if len(pending) == self._n_layers:
            raw = pending[self.layers[0]]
            first = self._view(*raw)
            offsets = self._offsets_of(pending, raw, first) if self._accepts(*first) else None
            table = None if offsets is None else self._offsets.upload(offsets)
        if table is None or first is None:
            for layer, xs in pending.items():
                self._single(layer, *self._view(*xs))
                self.single_launches += 1
            return
        partials = self._grouped(*first, table, self._n_layers, gate=self.group.kernel_gate)
        self.grouped_launches += 1
        if self._defer and not self._pending_captured and len(self._unfolded) < MAX_DEFERRED:
            self._unfolded.append((partials, self._samples(*first)))
        else:  # no flush for many forwards (a loop that never flushes): fold now
            self._fold(partials, self._samples(*first))

    @hot_path
    def finish(self) -> None:
        """Launch what is pending, then fold every deferred grouped result (every
        ``MetricSet.flush`` calls this before its copy)."""
        if self._pending_captured and self._pending:
            # Added inside a capture that ended before the last layer: launched now, they
            # would be read once, outside the graph, not at each replay.
            self.dropped_captured += len(self._pending)
            self._pending.clear()
            self.error = RuntimeError(
                f"a CUDA graph captured {self.dropped_captured} of the {self._n_layers} "
                "layers of a grouped launch (one graph per layer?): they record nothing; "
                "use launch='layer' (SYNCLESS_MONITOR_LAUNCH=layer) with per-layer graphs"
            )
        self.launch()
        unfolded, self._unfolded = self._unfolded, []
        for partials, samples in unfolded:
            self._fold(partials, samples)

    def take_error(self) -> Exception | None:
        """What went wrong since the last call (the handle counts and reports it)."""
        error, self.error = self.error, None
        return error

    def _fold(self, partials: torch.Tensor, samples: float) -> None:
        self.group.fold(partials, samples)
        if self._after is not None:
            self._after(partials, samples)

    def _offsets_of(
        self,
        pending: dict[int, tuple[torch.Tensor, ...]],
        raw: tuple[torch.Tensor, ...],
        first: tuple[torch.Tensor, ...],
    ) -> list[int] | None:
        """Element offsets of every layer's tensors from the first layer's (all of the
        first tensor's, then the second's, ...), or ``None`` if they differ in shape,
        dtype or strides, one is not 16-byte aligned (the grouped kernels tell the
        compiler the offsets keep that alignment, so their loads stay vectorized), or
        the first layer's view is a copy (then the other layers' views would be copies
        too, at other addresses).

        Tensors with equal shape, strides and dtype get views at the same offset from
        their own storage, so the offsets between the raw tensors are the offsets
        between the views.
        """
        out = []
        layers = self.layers
        for i, x0 in enumerate(raw):
            base = x0.data_ptr()
            if first[i].data_ptr() != base or base % 16:
                return None
            shape, stride, dtype, size = x0.shape, x0.stride(), x0.dtype, x0.element_size()
            for layer in layers:
                x = pending[layer][i]
                if x.shape != shape or x.dtype != dtype or x.stride() != stride:
                    return None
                delta = x.data_ptr() - base
                if delta % 16:
                    return None
                out.append(delta // size)
        return out
