"""The norms monitor's passes over parameters and gradients (syncless.monitors.norms).

Two ways to the same per-layer sums of squares: the fused Triton path
(``FusedBucket``: one launch per dtype bucket before the optimizer step, one after,
syncless.kernels.norms), and the foreach path (``_foreach_norm`` and one ``index_add_``)
wherever the fused one does not apply (CPU, a tensor the block table does not fit).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from syncless.hot_path import hot_path
from syncless.kernels.offsets import OffsetRing
from syncless.monitors.adapters.sites import DTensor  # guarded: builds without distributed


@hot_path
def group_sumsq(norms: list[torch.Tensor], group_ids: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Sum of squared per-tensor norms per group: ``[n_groups]`` float64 on the device.

    ``group_ids[i]`` is the group of ``norms[i]`` (fixed at registration). Float64,
    because a sum of squares over billions of parameters loses digits in float32.
    """
    squares = torch.stack(norms).to(torch.float64).square_()
    out = torch.zeros(n_groups, dtype=torch.float64, device=group_ids.device)
    return out.index_add_(0, group_ids, squares)


@hot_path
def foreach_norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-tensor L2 norms in float32 (one multi-tensor launch per chunk of tensors)."""
    return list(torch._foreach_norm(tensors, 2, dtype=torch.float32))


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (FSDP2 and tensor-parallel parameters and their
    gradients), the tensor itself otherwise: the passes read local memory only, and the
    flush's SUM over ranks adds the shards' sums of squares into the full tensor's."""
    return t._local_tensor if isinstance(t, DTensor) else t  # an attribute: no dispatch


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` differs across ranks by its own description: a DTensor placed other
    than replicated (``Shard``, strided shards, ``Partial``)."""
    return isinstance(p, DTensor) and any(not pl.is_replicate() for pl in p.placements)


@hot_path
def local_grads(params: list[nn.Parameter], dtensors: bool) -> list[torch.Tensor | None]:
    """The parameters' gradients (this rank's shards when ``dtensors``); ``None`` where
    a parameter has none (Python structure, not a tensor value: no sync).

    Megatron's ``DistributedDataParallel`` accumulates into ``p.main_grad`` and leaves
    ``p.grad`` unset: that buffer is the gradient then (reduced by
    ``finalize_model_grads`` before the optimizer steps)."""
    if not dtensors:
        return [_grad(p) for p in params]
    return [None if p.grad is None else local(p.grad) for p in params]


def _grad(p: nn.Parameter) -> torch.Tensor | None:
    return p.grad if p.grad is not None else getattr(p, "main_grad", None)


@hot_path
def grad_norms(grads: list[torch.Tensor | None], zero: torch.Tensor) -> list[torch.Tensor]:
    """Norms of the gradients, ``zero`` where a parameter has none."""
    present = [g for g in grads if g is not None]
    if len(present) == len(grads):
        return foreach_norms(present)
    norms = iter(foreach_norms(present) if present else [])
    return [zero if g is None else next(norms) for g in grads]


class _PreStep(NamedTuple):
    """What the fused pre-step gives one bucket: ``[n_groups]`` float64 sums."""

    params: torch.Tensor
    grads: torch.Tensor | None  # None: the gradients take the foreach path
    snapshot: torch.Tensor | None  # the flat copy, with update_ratio


class FusedBucket:
    """One dtype bucket's tensors through ``syncless.kernels.norms``: one launch before
    the step and one after, instead of ``_foreach_norm``'s chunked launches. Offsets are
    re-read from the tensors every active step (a model moved to another device, or
    gradients reallocated by ``zero_grad(set_to_none=True)``, change them) and uploaded
    only when they changed. A method returns ``None`` where the fused path does not
    apply (a tensor not contiguous or swapped, no free offsets buffer), and the caller
    takes the foreach path for that bucket. Gradients that do not fit (one missing, or
    of mixed dtypes) leave the parameters fused and only the gradients to foreach.
    """

    def __init__(self, tensors: list[torch.Tensor], groups: list[int], n_groups: int) -> None:
        # Imported here, once: the module needs Triton, which a CPU install may lack.
        from syncless.kernels import norms as fused

        self._fused = fused
        self.table = fused.BlockTable.build(list(tensors), groups, n_groups)
        device = tensors[0].device
        self.sizes = [t.numel() for t in tensors]
        # 0: the parameters' offsets, 1: the gradients'
        self._rings = (OffsetRing(device, len(tensors)), OffsetRing(device, len(tensors)))

    def _offsets(self, tensors: list[torch.Tensor], ring: int) -> torch.Tensor | None:
        offsets = self._fused.element_offsets(tensors, self.sizes)
        return None if offsets is None else self._rings[ring].upload(offsets)

    @hot_path
    def pre_step(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor | None],
        snapshot: bool,
        gate: torch.Tensor | None = None,
    ) -> _PreStep | None:
        """Both sums of squares and, with ``snapshot``, the flat copy: one launch that
        reads each parameter and its gradient once."""
        offsets = self._offsets(list(params), 0)
        if offsets is None:
            return None
        present = [g for g in grads if g is not None]
        grad_offsets = self._offsets(present, 1) if len(present) == len(grads) else None
        first = params[0]
        snap = None
        if snapshot:
            snap = torch.empty(self.table.total, dtype=first.dtype, device=first.device)
        sums = self._fused.group_param_grad_sumsq(
            first,
            offsets,
            self.table,
            first_grad=None if grad_offsets is None else present[0],
            grad_offsets=grad_offsets,
            snap=snap,
            gate=gate,
        )
        return _PreStep(sums[0], None if grad_offsets is None else sums[1], snap)

    @hot_path
    def diff_sumsq(
        self, params: list[torch.Tensor], snap: torch.Tensor, gate: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        offsets = self._offsets(list(params), 0)
        if offsets is None:
            return None
        return self._fused.group_diff_sumsq(params[0], offsets, self.table, snap, gate)

    def views(self, snap: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The flat snapshot as one view per parameter, for the foreach path."""
        return [s.view_as(p) for s, p in zip(snap.split(self.sizes), params, strict=True)]
