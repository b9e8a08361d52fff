"""Parameter norm, gradient norm and update/parameter ratio per layer.

No forward hooks: the monitor hooks the optimizer's step. On CUDA (Triton,
syncless.kernels.norms) an active step is two launches per dtype bucket. The pre-hook
reads each parameter and its gradient once: both per-layer sums of squares and, with
``update_ratio``, the flat snapshot of the parameters, written in the same pass. The
post-hook reads the parameters and the snapshot once: the update's sums of squares.
Per parameter element, with P bytes per parameter and G per gradient, that is 4P + G
bytes (P + G without ``update_ratio``): the floor for hooks outside the optimizer, and
why the monitor defaults to every 10 steps. Elsewhere (CPU, a tensor the block table
does not fit) ``_foreach_norm``, ``index_add_`` and ``_foreach_mul`` give the same
sums. An optimizer step captured in a CUDA graph runs the hooks' kernels at every
replay: the fused ones return at once when the monitor's gate is off, the foreach
path computes and records nothing. See docs/monitors/norms.md.

Cross-rank: a replicated (data-parallel) parameter is identical on every rank, a sharded
one (FSDP2 and FSDP1 shards, tensor-parallel or expert-parallel parts) is not. Sums of
squares of replicated parameters are ``max`` metrics (counted once however many ranks
hold them), those of sharded parameters ``sum`` metrics (each rank adds its shard,
divided by the replicas of HSDP); the norms are derived at flush as the square root of
the totals, no parameter is ever gathered. Which is which, the parameters say
themselves (syncless.monitors.norms_sharding).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from syncless import kernels
from syncless.errors import UsageError
from syncless.graphs import capturing
from syncless.hot_path import hot_path
from syncless.metrics import Readout, Slot, layer_scope
from syncless.monitors.adapters import ModelMap
from syncless.monitors.base import AREA, MonitorContext, check_every
from syncless.monitors.norms_passes import (
    FusedBucket,
    foreach_norms,
    grad_norms,
    group_sumsq,
    local,
    local_grads,
)
from syncless.monitors.norms_sharding import Layout, Member, find_members

QUANTITIES = ("param", "grad", "update")


def _nothing_sharded(name: str) -> bool:
    return False


@dataclass
class _Scatter:
    """Where one quantity's per-group sums go in the packed buffer: max slots
    (replicated groups) and sum slots with their counts (sharded groups). ``*_rows``
    pick the groups from the ``[n_groups]`` sums (``max_rows`` None: all, in order)."""

    max_rows: torch.Tensor | None = None
    max_at: torch.Tensor | None = None
    sum_rows: torch.Tensor | None = None
    sum_at: torch.Tensor | None = None
    count_at: torch.Tensor | None = None
    sum_scale: torch.Tensor | None = None  # 1 / replicas per sum row; None: all 1


def _scatter(groups: list[_Group], quantity: str, device: torch.device) -> _Scatter:
    def tensor(values: list, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device)

    out = _Scatter()
    replicated = [(i, g.slots[quantity]) for i, g in enumerate(groups) if not g.layout.sharded]
    sharded = [(i, g.slots[quantity]) for i, g in enumerate(groups) if g.layout.sharded]
    if replicated:
        rows = [i for i, _ in replicated]
        out.max_rows = None if rows == list(range(len(groups))) else tensor(rows)
        out.max_at = tensor([s.offsets[2] for _, s in replicated])  # type: ignore[index]
    if sharded:
        out.sum_rows = tensor([i for i, _ in sharded])
        out.sum_at = tensor([s.offsets[0] for _, s in sharded])  # type: ignore[index]
        out.count_at = tensor([s.offsets[1] for _, s in sharded])  # type: ignore[index]
        replicas = [groups[i].layout.replicas for i, _ in sharded]
        if any(r != 1 for r in replicas):
            out.sum_scale = tensor([1.0 / r for r in replicas], torch.float64)
    return out


@dataclass
class _Group:
    """The parameters of one layer with one cross-rank layout, and their slots (groups
    that differ only in ``replicas`` share the layer's sum slots)."""

    layer: int
    layout: Layout
    slots: dict[str, Slot]  # quantity -> slot (no "update" without update_ratio)


class NormsMonitor:
    """Per-layer parameter norm, gradient norm and update ratio, from optimizer hooks.

    ``NormsMonitor(optimizer, every=10, update_ratio=True, is_sharded=None, model=None)``

    - ``optimizer``: the optimizer whose ``step()`` is hooked. Only the mapped layers'
      parameters that this optimizer holds are measured (frozen ones are skipped).
    - ``every``: measure on every N-th step (the handle sets ``active``).
    - ``update_ratio``: also measure ``||p_after - p_before|| / ||p_before||``; costs one
      transient copy of the monitored parameters on active steps.
    - ``main_params``: for an optimizer that steps copies of the model's parameters
      (Megatron's fp32 main parameters, or their data-parallel shards under its
      distributed optimizer): ``id(copy) -> (the model parameter it stands for, the
      copy's Layout across ranks)``. The copy is measured in that parameter's layer.
    - ``is_sharded(name) -> bool``: which *plain* tensors differ across ranks (default:
      none), such as expert-parallel experts. DTensors (FSDP2, tensor parallel) and
      FSDP1's parameters say it themselves (syncless.monitors.norms_sharding) and are not
      asked about. ``name`` is the parameter's name in ``model.named_parameters()`` when
      ``model`` is given, else ``"layers.<layer index>.<name inside the block>"`` (e.g.
      ``layers.3.moe.experts.w_up``); ``syncless.demo.parallel.is_expert_param`` works
      with either.
    """

    name = "norms"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        every: int = 10,
        update_ratio: bool = True,
        is_sharded: Callable[[str], bool] | None = None,
        model: nn.Module | None = None,
        main_params: Mapping[int, tuple[nn.Parameter, Layout]] | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"NormsMonitor needs the torch.optim.Optimizer whose step() it hooks, got "
                f"{type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.every = check_every(every)
        self.active = True
        self.update_ratio = update_ratio
        self.is_sharded = is_sharded or _nothing_sharded
        self.model = model
        self.main_params = dict(main_params or {})
        self._groups: list[_Group] = []
        self._buckets: list[list[nn.Parameter]] = []  # one per dtype, for foreach fast paths
        self._dtensors: list[bool] = []  # per bucket: its parameters are DTensors
        # per bucket: (offset, numel) of each element in its FlatParameter's shard, or None
        self._views: list[list[tuple[int, int]] | None] = []
        # the derive's tables, over every rank's layers: layer -> quantity -> keys
        self._layer_keys: dict[int, dict[str, list[str]]] = {}
        self._bucket_groups: list[list[int]] = []  # each parameter's group, per bucket
        self._bucket_ids: list[torch.Tensor] = []  # the same on the bucket's device
        self._fused: list[FusedBucket | None] = []  # the Triton path per bucket, if any
        self._zero: torch.Tensor | None = None
        # per bucket: the fused flat copy, or the foreach path's list of copies
        self._snapshot: list[torch.Tensor | list[torch.Tensor]] | None = None
        self._own_handles: list = []
        self._scatter: dict[str, _Scatter] = {}
        self._buffer: torch.Tensor | None = None
        self._gate: torch.Tensor | None = None
        self._gate_on: torch.Tensor | None = None
        self.unmonitored_params = 0  # optimizer tensors outside every mapped layer

    # -- registration (cold) -----------------------------------------------------------

    def _names(self, ctx: MonitorContext) -> dict[int, str]:
        if self.model is not None:
            return {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        names: dict[int, str] = {}
        for site in ctx.model.layers:
            for n, p in site.block.named_parameters():
                names.setdefault(id(p), f"layers.{site.index}.{n}")
        return names

    def nothing_to_watch(self, model: ModelMap) -> str | None:
        """Why this model gives the monitor nothing to record, or None. The norms are
        per layer; an optimizer that steps none of the layers' parameters is a
        ``UsageError`` at ``prepare`` (the wrong optimizer, not a model without
        something to watch)."""
        return None if model.layers else "no transformer block the adapter found"

    def prepare(self, ctx: MonitorContext) -> None:
        in_optimizer = [p for g in self.optimizer.param_groups for p in g["params"]]
        members, self.unmonitored_params = find_members(
            in_optimizer,
            ctx.model.layers,
            ctx.roots,
            self.is_sharded,
            self._names(ctx),
            ctx.model.param_layout,
            self.main_params,
        )
        if not members and ctx.model.layers:
            raise UsageError(
                f"norms monitor: the optimizer steps {len(in_optimizer)} tensors and none "
                f"of them belongs to the {len(ctx.model.layers)} layers found (the norms "
                "are per layer): pass the optimizer that trains this model "
                "(build(..., optimizer=opt)), or leave norms out"
            )
        quantities = QUANTITIES if self.update_ratio else QUANTITIES[:2]
        slots: dict[tuple[int, bool], dict[str, Slot]] = {}
        group_of: dict[tuple[int, Layout], int] = {}
        # Static buckets per device and dtype: a foreach op over one dtype and device
        # takes the fused multi-tensor path; a mixed list falls back to one launch per
        # tensor. Pieces of FlatParameters are views taken at each active step.
        buckets: dict[tuple, list[tuple[Member, int]]] = {}
        for m in members:
            sharded = m.layout.sharded
            if (m.layer, sharded) not in slots:
                suffix = "sharded" if sharded else "replicated"
                slots[m.layer, sharded] = {
                    q: ctx.metrics.declare(
                        AREA, f"{q}_sumsq_{suffix}", "sum" if sharded else "max",
                        layer=m.layer, derive_global=False,
                    )
                    for q in quantities
                }  # fmt: skip
            if (m.layer, m.layout) not in group_of:
                group_of[m.layer, m.layout] = len(self._groups)
                self._groups.append(_Group(m.layer, m.layout, slots[m.layer, sharded]))
            p = m.param
            if p.numel() and (m.view is None or m.view[1]):  # empty shards add nothing
                key = (p.device, p.dtype, type(p), m.view is None)
                buckets.setdefault(key, []).append((m, group_of[m.layer, m.layout]))
        self._buckets = [[m.param for m, _ in b] for b in buckets.values()]
        self._dtensors = [local(b[0][0].param) is not b[0][0].param for b in buckets.values()]
        self._views = [
            None if b[0][0].view is None else [m.view for m, _ in b]  # type: ignore[misc]
            for b in buckets.values()
        ]
        self._bucket_groups = [[g for _, g in b] for b in buckets.values()]

    def attach(self, ctx: MonitorContext) -> None:
        buffer = ctx.metrics.buffer
        if buffer is None:
            raise RuntimeError("norms monitor: attach() before the metric set's allocate()")
        # Pipeline stages hold different layers: rank 0 derives every layer's norms from
        # the agreed schema, not only its own groups'.
        suffixes = ("replicated", "sharded")
        quantities = QUANTITIES if self.update_ratio else QUANTITIES[:2]
        for q in quantities:
            for suffix in suffixes:
                for layer, spec in ctx.metrics.layer_specs(AREA, f"{q}_sumsq_{suffix}").items():
                    self._layer_keys.setdefault(layer, {}).setdefault(q, []).append(spec.key)
        self._layer_keys = dict(sorted(self._layer_keys.items()))
        if not self._buckets:  # nothing of ours to measure (no layer, or empty shards)
            return
        device = self._buckets[0][0].device
        self._zero = torch.zeros((), dtype=torch.float32, device=device)
        self._scatter = {q: _scatter(self._groups, q, buffer.device) for q in quantities}
        self._buffer = buffer
        # The gate its metrics were declared under (attach: the monitor's name).
        first_slot = next(iter(self._groups[0].slots.values()))
        self._gate, self._gate_on = ctx.metrics.gate_views(ctx.metrics.gate_of(first_slot.spec.key))
        n = len(self._groups)
        self._fused = [
            FusedBucket(self._locals(i), groups, n) if kernels.use_triton(bucket[0]) else None
            for i, (bucket, groups) in enumerate(
                zip(self._buckets, self._bucket_groups, strict=True)
            )
        ]
        self._bucket_ids = [
            torch.tensor(groups, dtype=torch.int64).to(bucket[0].device)
            for bucket, groups in zip(self._buckets, self._bucket_groups, strict=True)
        ]
        self._own_handles = [
            self.optimizer.register_step_pre_hook(ctx.timed(self.name, self._pre_step)),
            self.optimizer.register_step_post_hook(ctx.timed(self.name, self._post_step)),
        ]
        ctx.handles += self._own_handles

    # -- optimizer hooks (hot) ---------------------------------------------------------

    @hot_path
    def _locals(self, i: int) -> list[torch.Tensor]:
        """Bucket ``i``'s parameters as this rank holds them (DTensors' local shards,
        FlatParameter pieces), read again every active step: FSDP may have swapped their
        storage."""
        bucket = self._buckets[i]
        if self._dtensors[i]:
            return [local(p) for p in bucket]
        views = self._views[i]
        if views is not None:
            return [p.narrow(0, at, n) for p, (at, n) in zip(bucket, views, strict=True)]
        return bucket

    @hot_path
    def _grads(self, i: int) -> list[torch.Tensor | None]:
        views = self._views[i]
        if views is None:
            return local_grads(self._buckets[i], self._dtensors[i])
        return [
            None if p.grad is None else p.grad.narrow(0, at, n)
            for p, (at, n) in zip(self._buckets[i], views, strict=True)
        ]

    @hot_path
    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        assert self._zero is not None  # set by attach()
        if not self.active and not capturing(self._zero.is_cuda):
            return
        with torch.no_grad():
            params: torch.Tensor | None = None
            grads: torch.Tensor | None = None
            snapshots: list = []
            for i in range(len(self._buckets)):
                bucket = self._locals(i)
                grads_i = self._grads(i)
                fused = self._fused[i]
                ids = self._bucket_ids[i]
                pre = (
                    fused.pre_step(bucket, grads_i, self.update_ratio, self._gate)
                    if fused is not None
                    else None
                )
                if pre is None:
                    p = group_sumsq(foreach_norms(bucket), ids, len(self._groups))
                    g, snap = None, None
                    if self.update_ratio:
                        # x * 1.0 is x exactly (finite or not); the foreach op allocates
                        # every copy in C++, where an empty_like per parameter is a torch
                        # call each.
                        snap = list(torch._foreach_mul(bucket, 1.0))
                else:
                    p, g, snap = pre
                if g is None:
                    g = group_sumsq(grad_norms(grads_i, self._zero), ids, len(self._groups))
                params = p if params is None else params + p
                grads = g if grads is None else grads + g
                if snap is not None:
                    snapshots.append(snap)
            assert params is not None and grads is not None
            self._record("param", params)
            self._record("grad", grads)
            if self.update_ratio:
                self._snapshot = snapshots

    @hot_path
    def _post_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is None:  # inactive step, or update_ratio off
            return
        with torch.no_grad():
            total: torch.Tensor | None = None
            for i, snap in enumerate(snapshot):
                bucket = self._locals(i)
                fused = self._fused[i]
                u = None
                if isinstance(snap, torch.Tensor):  # the fused snapshot: one flat copy
                    assert fused is not None
                    u = fused.diff_sumsq(bucket, snap, self._gate)
                    if u is None:  # no free offsets buffer: the copy through views
                        snap = fused.views(snap, bucket)
                if u is None:
                    torch._foreach_sub_(snap, bucket)  # in place: before - after
                    u = group_sumsq(foreach_norms(snap), self._bucket_ids[i], len(self._groups))
                total = u if total is None else total + u
            assert total is not None
            self._record("update", total)

    @hot_path
    def _record(self, quantity: str, sums: torch.Tensor) -> None:
        """Every group's sum of squares into its slot in 2-5 ops, not 2-3 per group
        (a group per layer and sharding class: 24 on the demo large model on one GPU).
        Gated like the slot ops: the device-side enable flag leaves the buffer as it was."""
        at = self._scatter[quantity]
        buf = self._buffer
        assert buf is not None and self._gate is not None and self._gate_on is not None
        if at.max_at is not None:
            values = sums if at.max_rows is None else sums.index_select(0, at.max_rows)
            values = torch.where(self._gate_on, values, -torch.inf)
            buf.scatter_reduce_(0, at.max_at, values, "amax")
        if at.sum_at is not None and at.sum_rows is not None and at.count_at is not None:
            values = sums.index_select(0, at.sum_rows)
            if at.sum_scale is not None:  # HSDP: each shard summed once per replica
                values = values * at.sum_scale
            # where(), not a product with the gate: NaN * 0 is NaN, and a captured step
            # whose gate is off must leave the buffer as it was.
            buf.index_add_(0, at.sum_at, torch.where(self._gate_on, values, 0.0))
            buf.index_add_(0, at.count_at, self._gate.expand(at.count_at.shape[0]))

    # -- flush (cold) ------------------------------------------------------------------

    def derive(self, readout: Readout) -> dict[str, float]:
        out: dict[str, float] = {}
        totals = dict.fromkeys(QUANTITIES, 0.0)
        seen_any = dict.fromkeys(QUANTITIES, False)
        bad_grads: list[int] = []  # layers whose gradient held a NaN/Inf (or overflowed)
        for layer, keys in self._layer_keys.items():
            sums = _layer_sums(readout, keys)
            if not sums:
                continue
            if not math.isfinite(sums.get("grad", 0.0)):
                bad_grads.append(layer)
            out.update(_norms(f"{AREA}/{layer_scope(layer)}", sums))
            for q, v in sums.items():
                totals[q] += v
                seen_any[q] = True
        if seen_any["param"]:
            out.update(_norms(f"{AREA}/global", {q: totals[q] for q in QUANTITIES if seen_any[q]}))
            out[f"{AREA}/global/norms_unmonitored_params_count"] = float(self.unmonitored_params)
        if bad_grads:  # the nonfinite alarm reads the same sums (syncless.monitors.alarm)
            out[f"{AREA}/step/grad_nonfinite_layers_count"] = float(len(bad_grads))
            out[f"{AREA}/step/grad_nonfinite_first_layer"] = float(bad_grads[0])
        return out

    def close(self) -> None:
        for h in self._own_handles:
            h.remove()
        self._own_handles = []
        self._snapshot = None


def _layer_sums(readout: Readout, keys: dict[str, list[str]]) -> dict[str, float]:
    """Cluster-wide sums of squares of one layer per quantity (its classes added up)."""
    sums: dict[str, float] = {}
    for q, names in keys.items():
        for key in names:
            if key in readout.present and readout.present[key].all():
                sums[q] = sums.get(q, 0.0) + float(readout.values[key][0])
    return sums


def _norms(scope: str, sums: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    if "param" in sums:
        out[f"{scope}/param_norm"] = math.sqrt(sums["param"])
    if "grad" in sums:
        out[f"{scope}/grad_norm"] = math.sqrt(sums["grad"])
    if "update" in sums and "param" in sums:
        p = sums["param"]
        out[f"{scope}/update_ratio"] = math.sqrt(sums["update"] / p) if p > 0 else math.nan
    return out
