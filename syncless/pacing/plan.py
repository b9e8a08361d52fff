"""A dispatch plan: the split lists of one expert-parallel all_to_all, and what pins them.

An expert-parallel MoE layer hands ``all_to_all_single`` Python split lists: how many
token rows this rank sends to each rank and receives from each. They come from the
router's per-expert counts, so computing them means reading counts back to the host.
``DispatchPlan`` is those lists plus the device tensors a dispatcher needs with them;
``PlanKey`` is what a plan depends on when the router's counts do not depend on its
input (see ``StaticPlanCache``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PlanKey:
    """The quantities that pin the plan of a *static* router on one rank.

    ``expert_owners[e]`` is the rank that owns global expert ``e``. A router whose
    counts change with the batch is not pinned by any key: that is what
    ``StaticPlanCache``'s validation mode catches.
    """

    tokens: int
    top_k: int
    world_size: int
    expert_owners: tuple[int, ...]
    device: str

    @classmethod
    def contiguous(
        cls, tokens: int, top_k: int, world_size: int, n_experts: int, device: torch.device | str
    ) -> PlanKey:
        """Experts sharded in contiguous blocks: rank r owns ``n_experts / world`` in a row."""
        per_rank = n_experts // world_size
        owners = tuple(e // per_rank for e in range(n_experts))
        return cls(tokens, top_k, world_size, owners, str(device))

    def describe(self) -> str:
        n_experts = len(self.expert_owners)
        return (
            f"tokens={self.tokens} top_k={self.top_k} world_size={self.world_size} "
            f"experts={n_experts} owners={list(self.expert_owners)} device={self.device}"
        )


@dataclass(frozen=True, eq=False, slots=True)
class DispatchPlan:
    """Split lists for one dispatch, on the host, and their device-side companions.

    ``send_counts[e]``: rows this rank sends to global expert ``e``.
    ``recv_counts[r * n_local + e]``: rows this rank receives from rank ``r`` for its
    local expert ``e`` (``all_to_all_single`` delivers them rank-major).
    ``regroup``: the permutation that sorts the received rows by local expert.
    ``send_counts_device``: ``send_counts`` on the device, the reference a validation
    compares fresh counts against without reading them back.
    ``local_counts_device``: ``local_counts`` on the device, for expert kernels that
    take their group sizes there.
    """

    send_counts: list[int]
    recv_counts: list[int]
    in_splits: list[int]  # rows to each rank
    out_splits: list[int]  # rows from each rank
    local_counts: list[int]  # received rows per local expert
    send_counts_device: torch.Tensor
    regroup: torch.Tensor
    local_counts_device: torch.Tensor

    @classmethod
    def build(
        cls,
        send_counts: list[int],
        recv_counts: list[int],
        send_counts_device: torch.Tensor,
        recv_counts_device: torch.Tensor,
        world_size: int,
    ) -> DispatchPlan:
        """From counts already on the host (lists) and on the device (tensors).

        No host sync: every size below is a Python int from the lists.
        """
        n_local = len(send_counts) // world_size
        in_splits = [sum(send_counts[r * n_local : (r + 1) * n_local]) for r in range(world_size)]
        out_splits = [sum(recv_counts[r * n_local : (r + 1) * n_local]) for r in range(world_size)]
        local_counts = [sum(recv_counts[e::n_local]) for e in range(n_local)]
        device = recv_counts_device.device
        local_ids = torch.arange(n_local, device=device).repeat(world_size)
        local_ids = local_ids.repeat_interleave(recv_counts_device, output_size=sum(out_splits))
        regroup = local_ids.argsort(stable=True)
        local_counts_device = recv_counts_device.view(world_size, n_local).sum(0)
        return cls(
            send_counts, recv_counts, in_splits, out_splits, local_counts,
            send_counts_device, regroup, local_counts_device,
        )  # fmt: skip

    def describe(self) -> str:
        return (
            f"sends {self.in_splits} rows to ranks, receives {self.out_splits}, "
            f"{self.local_counts} rows per local expert"
        )
