"""Token dispatch to experts: all local, or expert parallel with all_to_all_single.

Both dispatchers are the *standard* code most MoE trainers run: token counts per
expert are read back to the host once per layer (``.tolist()``) because
``Tensor.split`` and ``all_to_all_single`` take Python split lists. That drain blocks
the host until everything enqueued before it has finished; later issues measure and
remove it (syncless.pacing). Keep it here on purpose: it is the baseline. Each drain
sits in ``allow_sync``: it is intended, so tests can run the model under ``no_sync()``
to prove the monitors' hooks sync-free, while ``census()`` still counts it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from syncless.guard import allow_sync

if TYPE_CHECKING:
    from syncless.demo.model import Experts


class Dispatcher(Protocol):
    def local_experts(self, n_experts: int) -> int: ...

    def first_local_expert(self, n_experts: int) -> int: ...

    def __call__(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, fn: Experts
    ) -> torch.Tensor:
        """x [T, d], experts/weights [T, k] -> sum_k weights * expert_k(x), [T, d]."""
        ...


def _count_per_expert(flat_experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    # index_add_ rather than bincount: bincount reads the max back to the host on CUDA.
    counts = torch.zeros(n_experts, dtype=torch.int64, device=flat_experts.device)
    return counts.index_add_(0, flat_experts, torch.ones_like(flat_experts))


def _sort_by_expert(
    x: torch.Tensor, experts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row per (token, choice), grouped by expert: (rows, order, flat expert ids)."""
    flat = experts.reshape(-1)
    order = flat.argsort(stable=True)
    return x[order // experts.shape[1]], order, flat


def _combine(y_sorted: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Undo the expert grouping and sum each token's k expert outputs by weight."""
    y = y_sorted.new_empty(y_sorted.shape).index_copy(0, order, y_sorted)
    t, k = weights.shape
    return (y.view(t, k, -1) * weights.unsqueeze(-1).to(y.dtype)).sum(1)


class LocalDispatcher:
    """Every expert lives on this rank."""

    def local_experts(self, n_experts: int) -> int:
        return n_experts

    def first_local_expert(self, n_experts: int) -> int:
        return 0

    def __call__(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, fn: Experts
    ) -> torch.Tensor:
        rows, order, flat = _sort_by_expert(x, experts)
        n_experts = fn.w_gate.shape[0]
        with allow_sync("demo baseline: per-layer count drain for split()"):
            counts = _count_per_expert(flat, n_experts).tolist()
        return _combine(fn(rows, counts), order, weights)


def call_collective(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The default way a dispatcher runs a collective: just run it.

    A profiler replaces it (``dispatcher.comm = prof.collective``) to time each
    collective as enqueue / rendezvous wait / transfer.
    """
    return fn(*args, **kwargs)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd: the backward sends gradients the reverse way."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group, comm, name):  # type: ignore[override]
        ctx.splits, ctx.group, ctx.comm, ctx.name = (out_splits, in_splits), group, comm, name
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        comm(name, dist.all_to_all_single, out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        grad_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        ctx.comm(f"{ctx.name}_bwd", dist.all_to_all_single, grad_in, grad.contiguous(),
                 in_splits, out_splits, group=ctx.group)  # fmt: skip
        return grad_in, None, None, None, None, None


class AllToAllDispatcher:
    """Experts sharded over the ranks of ``group``: rank r owns a contiguous block.

    Per layer: count tokens per global expert; exchange the counts (all_to_all); read
    send and receive counts to the host in one drain; all_to_all the token rows; run
    the local experts; all_to_all the results back.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.comm: Callable[..., Any] = call_collective
        # Appended to collective names ("moe_dispatch" + label): a per-layer trace sets
        # it before each layer, and the backward reuses the forward's name.
        self.label = ""

    def local_experts(self, n_experts: int) -> int:
        return n_experts // self.world

    def first_local_expert(self, n_experts: int) -> int:
        return self.rank * self.local_experts(n_experts)

    def __call__(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, fn: Experts
    ) -> torch.Tensor:
        n_local = fn.w_gate.shape[0]
        n_experts = n_local * self.world
        rows, order, flat = _sort_by_expert(x, experts)  # grouped by expert = by owner rank
        send_counts = _count_per_expert(flat, n_experts)
        recv_counts = torch.empty_like(send_counts)  # [src rank, my local expert]
        self.comm(
            f"moe_counts{self.label}",
            dist.all_to_all_single,
            recv_counts,
            send_counts,
            group=self.group,
        )
        with allow_sync("demo baseline: per-layer count drain for all_to_all splits"):
            send, recv = torch.stack((send_counts, recv_counts)).tolist()
        in_splits = [sum(send[r * n_local : (r + 1) * n_local]) for r in range(self.world)]
        out_splits = [sum(recv[r * n_local : (r + 1) * n_local]) for r in range(self.world)]

        received = _AllToAll.apply(
            rows, out_splits, in_splits, self.group, self.comm, f"moe_dispatch{self.label}"
        )
        # Received rows are grouped by source rank, then by local expert; regroup by expert.
        local_ids = torch.arange(n_local, device=x.device).repeat(self.world)
        local_ids = local_ids.repeat_interleave(recv_counts, output_size=sum(out_splits))
        regroup = local_ids.argsort(stable=True)
        local_counts = [sum(recv[e::n_local]) for e in range(n_local)]
        y_local = fn(received[regroup], local_counts)
        y_received = y_local.new_empty(y_local.shape).index_copy(0, regroup, y_local)
        y_rows = _AllToAll.apply(
            y_received, in_splits, out_splits, self.group, self.comm, f"moe_combine{self.label}"
        )
        return _combine(y_rows, order, weights)
