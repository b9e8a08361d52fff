"""Token dispatch to experts: all local, or expert parallel with all_to_all_single.

The local dispatcher groups the rows by expert on the device and hands the experts
their counts as a device tensor: nothing is read back to the host (the experts' impl
decides how they run, syncless.demo.experts).

The expert-parallel dispatcher needs Python split lists for ``all_to_all_single``:
token counts per expert must reach the host once per layer. Where it takes them from
is ``--ep-splits`` (syncless.pacing, docs/pacing.md): a drain (``.tolist()``, the
standard code most MoE trainers run, kept as the baseline), a late read from pinned
host memory (lookahead), or a static plan cache, with or without a run-ahead limit.
Each drain sits in ``allow_sync``: it is intended, so tests can run the model under
``no_sync()`` to prove the monitors' hooks sync-free, while ``census()`` still counts it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from syncless.demo.config import DEFAULT_RUN_AHEAD, EP_SPLITS
from syncless.demo.experts import Experts
from syncless.guard import allow_sync
from syncless.pacing import (
    DispatchPlan,
    HostLanding,
    PlanKey,
    RunAheadLimiter,
    StaticPlanCache,
    StaticPlanError,
)


class Dispatcher(Protocol):
    def local_experts(self, n_experts: int) -> int: ...

    def first_local_expert(self, n_experts: int) -> int: ...

    def __call__(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, fn: Experts
    ) -> torch.Tensor:
        """x [T, d], experts/weights [T, k] -> sum_k weights * expert_k(x), [T, d]."""
        ...

    def end_step(self) -> None:
        """After each training step (cold path)."""
        ...

    def report(self) -> dict[str, float]:
        """Metric values since the last report (cold path; may be a collective)."""
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
    """Every expert lives on this rank; rows are grouped by expert on the device."""

    def local_experts(self, n_experts: int) -> int:
        return n_experts

    def first_local_expert(self, n_experts: int) -> int:
        return 0

    def __call__(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, fn: Experts
    ) -> torch.Tensor:
        tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)
        counts = _count_per_expert(flat, fn.n_local)
        # A token's k choices are distinct experts: no expert gets more than `tokens` rows.
        y = fn(x, counts, index=order // top_k, max_rows=tokens)
        return _combine(y, order, weights)

    def end_step(self) -> None:
        pass

    def report(self) -> dict[str, float]:
        return {}


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

    Per layer: a dispatch plan (the split lists), the token rows all_to_all, the local
    experts, the results all_to_all back. Where the plan comes from:

    * default (``drain``, the baseline): count tokens per global expert, exchange the
      counts (all_to_all), read send and receive counts to the host in one drain;
    * ``plan_cache`` (enabled): computed that way once per ``PlanKey``, then reused
      with no exchange and no drain (its probes put one of the two back);
    * ``limiter``: a ``RunAheadLimiter`` point before each layer's token dispatch;
    * ``lookahead``: counts and their exchange first, their copy to pinned host memory
      issued without blocking, the token sort enqueued behind it, the read last.

    ``for_mode`` builds each ``--ep-splits`` mode.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        plan_cache: StaticPlanCache | None = None,
        limiter: RunAheadLimiter | None = None,
        lookahead: bool = False,
    ) -> None:
        if lookahead and plan_cache is not None:
            raise ValueError("lookahead reads fresh counts every layer: it takes no plan cache")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.comm: Callable[..., Any] = call_collective
        # Appended to collective names ("moe_dispatch" + label): a per-layer trace sets
        # it before each layer, and the backward reuses the forward's name.
        self.label = ""
        self.plan_cache = plan_cache
        self.limiter = limiter
        self.landing = HostLanding() if lookahead else None
        self.drains = 0
        self.drain_s = 0.0
        self._owners: dict[int, tuple[int, ...]] = {}
        self._reported: dict[str, float] = {}

    @classmethod
    def for_mode(
        cls,
        mode: str,
        *,
        run_ahead: int = DEFAULT_RUN_AHEAD,
        device: torch.device | str | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> AllToAllDispatcher:
        """The dispatcher of ``--ep-splits MODE``.

        The static modes opt in through the API flag (``enabled=True``); how often the
        cache validates is ``SYNCLESS_STATIC_PLAN_VALIDATE_EVERY`` (default: never, which
        the fixed router allows: its plan cannot change).
        """
        if mode == "drain":
            return cls(group)
        if mode == "lookahead":
            return cls(group, lookahead=True)
        if mode in ("static", "static-paced"):
            limiter = RunAheadLimiter(run_ahead, device=device) if mode == "static-paced" else None
            return cls(group, plan_cache=StaticPlanCache(enabled=True), limiter=limiter)
        raise ValueError(
            f"unknown --ep-splits mode {mode!r}; expected one of {', '.join(EP_SPLITS)}"
        )

    def local_experts(self, n_experts: int) -> int:
        return n_experts // self.world

    def first_local_expert(self, n_experts: int) -> int:
        return self.rank * self.local_experts(n_experts)

    def __call__(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, fn: Experts
    ) -> torch.Tensor:
        n_experts = fn.n_local * self.world
        if self.landing is not None:
            plan, rows, order = self._lookahead(x, experts, n_experts)
        else:
            rows, order, flat = _sort_by_expert(x, experts)  # grouped by expert = by owner rank
            plan = self._plan(x, experts, flat, n_experts)
        if self.limiter is not None:
            self.limiter.point()  # before the host enqueues this layer's dispatch
        to_ranks, from_ranks, group, comm = plan.in_splits, plan.out_splits, self.group, self.comm
        received = _AllToAll.apply(
            rows, from_ranks, to_ranks, group, comm, f"moe_dispatch{self.label}"
        )
        # Received rows are grouped by source rank, then by local expert; regroup by expert.
        y_local = fn(
            received,
            plan.local_counts_device,
            index=plan.regroup,
            host_counts=plan.local_counts,
        )
        y_received = y_local.new_empty(y_local.shape).index_copy(0, plan.regroup, y_local)
        y_rows = _AllToAll.apply(
            y_received, to_ranks, from_ranks, group, comm, f"moe_combine{self.label}"
        )
        return _combine(y_rows, order, weights)

    # -- where the plan comes from (hot path) -------------------------------------------

    def _plan(
        self, x: torch.Tensor, experts: torch.Tensor, flat: torch.Tensor, n_experts: int
    ) -> DispatchPlan:
        cache = self.plan_cache
        if cache is None:
            return self._drained_plan(
                flat, n_experts, "demo baseline: per-layer count drain for all_to_all splits"
            )
        tokens, top_k = experts.shape
        key = PlanKey(tokens, top_k, self.world, self._expert_owners(n_experts), str(x.device))
        plan = cache.get(key)  # None when not opted in: counted, so a report shows it
        if plan is None:
            plan = self._drained_plan(flat, n_experts, "static plan: computed per key")
            if cache.enabled:
                cache.put(key, plan)
            return plan
        if cache.exchanges_counts or cache.drains or cache.validating:
            send = _count_per_expert(flat, n_experts)
            if cache.exchanges_counts:  # probe no-drains: the exchange the cache removed
                self._exchange(send)
            if cache.drains:  # probe no-collective: the drain the cache removed
                self._drain(send, "static plan probe no-collective: the per-layer drain kept")
            cache.validate(plan, send)
        return plan

    def _drained_plan(self, flat: torch.Tensor, n_experts: int, reason: str) -> DispatchPlan:
        send = _count_per_expert(flat, n_experts)
        recv = self._exchange(send)  # [src rank, my local expert]
        counts = self._drain(torch.cat((send, recv)), reason)  # one drain for both
        return DispatchPlan.build(counts[:n_experts], counts[n_experts:], send, recv, self.world)

    def _lookahead(
        self, x: torch.Tensor, experts: torch.Tensor, n_experts: int
    ) -> tuple[DispatchPlan, torch.Tensor, torch.Tensor]:
        """Counts as early as the routing allows, read as late as the dispatch allows.

        The router of layer i+1 reads layer i's output, so its counts cannot be known
        during layer i (docs/pacing.md). Within the layer: count, exchange, start the
        host copy, then enqueue the sort, so the device works while the counts travel.
        """
        landing = self.landing
        assert landing is not None
        send = _count_per_expert(experts.reshape(-1), n_experts)
        recv = self._exchange(send)
        landing.issue(torch.cat((send, recv)))
        rows, order, _ = _sort_by_expert(x, experts)
        counts = landing.read()
        plan = DispatchPlan.build(counts[:n_experts], counts[n_experts:], send, recv, self.world)
        return plan, rows, order

    def _exchange(self, send_counts: torch.Tensor) -> torch.Tensor:
        recv_counts = torch.empty_like(send_counts)
        self.comm(
            f"moe_counts{self.label}",
            dist.all_to_all_single,
            recv_counts,
            send_counts,
            group=self.group,
        )
        return recv_counts

    def _drain(self, counts: torch.Tensor, reason: str) -> list[int]:
        start = time.perf_counter()
        with allow_sync(reason):
            values = counts.tolist()
        self.drain_s += time.perf_counter() - start
        self.drains += 1
        return values

    def _expert_owners(self, n_experts: int) -> tuple[int, ...]:
        owners = self._owners.get(n_experts)
        if owners is None:
            per_rank = self.local_experts(n_experts)
            owners = self._owners[n_experts] = tuple(e // per_rank for e in range(n_experts))
        return owners

    # -- cold path ----------------------------------------------------------------------

    def end_step(self) -> None:
        if self.plan_cache is not None:
            self.plan_cache.step()

    def report(self) -> dict[str, float]:
        """Pacing counters since the last report, as ``pacing/...`` metric values.

        Host time blocked in the dispatch (``pacing/step/blocked_ms``) is the sum of
        the drains, run-ahead waits and lookahead waits. With a validating plan cache
        this reads the mismatch counter, takes its maximum over the ranks (one scalar
        all_reduce: call it on every rank at the same step) and raises
        ``StaticPlanError`` if any validated reuse did not match.
        """
        totals = self._totals()
        out = {f"pacing/{k}": v - self._reported.get(k, 0.0) for k, v in totals.items()}
        self._reported = totals
        if out.get("pacing/plan/mismatches_count", 0.0) > 0:
            raise StaticPlanError(
                f"static dispatch plan: {int(totals['plan/mismatches_count'])} validated "
                "reuse(s) did not match the router's counts: tokens went to the wrong "
                "experts. The router is not static; use --ep-splits drain or lookahead."
            )
        return out

    def _totals(self) -> dict[str, float]:
        totals: dict[str, float] = {
            "step/drains_count": self.drains,
            "step/drain_wait_ms": self.drain_s * 1e3,
        }
        blocked_s = self.drain_s
        if self.limiter is not None:
            s = self.limiter.stats()
            totals["step/run_ahead_points_count"] = s["points"]
            totals["step/run_ahead_unpaced_count"] = s["unpaced_points"]
            totals["step/run_ahead_waits_count"] = s["waits"]
            totals["step/run_ahead_wait_ms"] = s["wait_s"] * 1e3
            blocked_s += s["wait_s"]
        if self.landing is not None:
            s = self.landing.stats()
            totals["step/lookahead_reads_count"] = s["reads"]
            totals["step/lookahead_waits_count"] = s["waits"]
            totals["step/lookahead_wait_ms"] = s["wait_s"] * 1e3
            blocked_s += s["wait_s"]
        totals["step/blocked_ms"] = blocked_s * 1e3
        cache = self.plan_cache
        if cache is not None:
            s = cache.stats()
            totals["plan/hits_count"] = s["hits"]
            totals["plan/misses_count"] = s["misses"]
            totals["plan/disabled_lookups_count"] = s["disabled_lookups"]
            totals["plan/validations_count"] = s["validations"]
            totals["plan/unchecked_reuses_count"] = s["unchecked_reuses"]
            if cache.validate_every > 0:  # the same on every rank: so is the collective
                n = cache.mismatches(all_ranks=True, group=self.group)
                totals["plan/mismatches_count"] = n
        return totals
