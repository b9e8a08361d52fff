"""MoE router health per layer: expert load and its balance, router z-loss, top-k mass,
dead experts.

Hot path, once per forward of each MoE layer (the router-logits callback): the top-k
choice is recomputed from the logits and counted per expert with ``index_add_`` (never
``bincount``/``one_hot``, which read a maximum back to the host on CUDA), and three
slots are recorded. Softmax router, fp32 logits: softmax, topk, sum (top-k mass),
gather + log + sub (logsumexp from the top-1 expert), dot (z-loss), zeros + index_add_
(counts), then 3 slot adds of 2 kernels each: 15 kernels (+1 cast for bf16 logits).

Everything that needs the whole cluster's load (imbalance, coefficient of variation,
entropy, dead experts) is derived at flush from the per-expert counts *after* the
metric core summed them across ranks: the imbalance of the summed counts, not the
average of each rank's imbalance. See docs/monitors/moe.md.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from syncless import kernels
from syncless.graphs import capturing
from syncless.hot_path import hot_path
from syncless.metrics import MetricSpec, Readout, Slot
from syncless.metrics.slot_group import Column, SlotGroup
from syncless.monitors.adapters import ModelMap, RouterSite
from syncless.monitors.base import AREA, MonitorContext, check_every
from syncless.monitors.layer_batch import LayerBatch, launch_mode

SCORES = ("softmax", "sigmoid")
TOKENS = "moe_tokens_count"
# Derived per layer at flush, in this order: imbalance, cv, entropy fraction, dead experts.
DERIVED = (
    "moe_imbalance",
    "moe_load_cv",
    "moe_utilization_entropy_frac",
    "moe_dead_experts_count",
)


class RouterStats(NamedTuple):
    """One forward's router statistics, on the device (sums over this rank's tokens)."""

    counts: torch.Tensor  # [n_experts] float64: tokens routed to each expert (k per token)
    zloss_sum: torch.Tensor  # 0-dim: sum over tokens of logsumexp(logits)^2
    mass_sum: torch.Tensor  # 0-dim: sum over tokens of the chosen experts' score share


class LoadStats(NamedTuple):
    """Balance of one layer's per-expert token counts (host side, at flush)."""

    imbalance: float  # max / mean; 1 is perfectly balanced, n_experts is one expert only
    cv: float  # population std / mean; 0 is perfectly balanced
    entropy_frac: float  # entropy of counts/sum over log(n_experts); 1 is uniform


@hot_path
def router_stats(logits: torch.Tensor, top_k: int, score: str, one: torch.Tensor) -> RouterStats:
    """Per-expert counts, z-loss sum and top-k mass sum of router logits ``[T, n_experts]``.

    ``top_k`` and ``score`` are the router's static configuration (from the site, never
    from a tensor); ``one`` is a 0-dim float64 one on the logits' device, expanded as the
    ``index_add_`` source so counting allocates no ``[T * k]`` ones tensor.

    The top-k *mass* is the share of the token's score mass held by the chosen experts:
    for softmax that is the sum of the chosen probabilities; for sigmoid scores (which
    do not sum to one) the chosen scores over the sum of all scores, so both lie in
    [0, 1] and compare across router types.
    """
    x = logits.float()  # a no-op for fp32 logits; the statistics need fp32 under bf16
    n_experts = x.shape[-1]
    if score == "softmax":  # a static router property, not a tensor value
        scores = x.softmax(dim=-1)
        top, experts = scores.topk(top_k, dim=-1)  # sorted: column 0 is the top-1 expert
        mass_sum = top.sum()
        # logsumexp from the top-1 expert: p1 = exp(x1 - lse), so lse = x1 - log(p1).
        # p1 >= 1/n_experts never underflows; 3 kernels where logsumexp() launches ~5.
        lse = x.gather(-1, experts[:, :1]).sub_(top[:, :1].log()).view(-1)
    else:
        scores = x.sigmoid()
        top, experts = scores.topk(top_k, dim=-1, sorted=False)
        mass_sum = (top.sum(dim=-1) / scores.sum(dim=-1)).sum()
        lse = torch.logsumexp(x, dim=-1)
    counts = torch.zeros(n_experts, dtype=torch.float64, device=x.device)
    flat = experts.reshape(-1)
    counts.index_add_(0, flat, one.expand(flat.shape[0]))
    return RouterStats(counts, torch.dot(lse, lse), mass_sum)


@hot_path
def router_stats_from_map(
    logits: torch.Tensor, routing_map: torch.Tensor, score: str
) -> RouterStats:
    """:func:`router_stats` with the experts the router itself chose, ``routing_map``
    ``[T, n_experts]`` bool: the counts are its column sums and the top-k mass is the
    chosen experts' share of the score mass, whatever rule chose them."""
    x = logits.float()
    counts = routing_map.sum(dim=0, dtype=torch.float64)
    chosen = routing_map.to(x.dtype)
    lse = torch.logsumexp(x, dim=-1)
    if score == "softmax":  # a static router property, not a tensor value
        mass_sum = (x.softmax(dim=-1) * chosen).sum()
    else:
        scores = x.sigmoid()
        mass_sum = ((scores * chosen).sum(dim=-1) / scores.sum(dim=-1)).sum()
    return RouterStats(counts, torch.dot(lse, lse), mass_sum)


def load_stats(counts: np.ndarray) -> LoadStats:
    """Imbalance, coefficient of variation and normalised entropy of expert counts."""
    imbalance, cv, entropy_frac = load_stats_rows(np.asarray(counts, dtype=np.float64)[None])
    return LoadStats(float(imbalance[0]), float(cv[0]), float(entropy_frac[0]))


def load_stats_rows(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`load_stats` of every row of ``counts`` ``[layers, n_experts]`` at once.

    Rows with no token give NaN. One pass for all layers: a per-layer loop cost ~1 ms
    per flush on the demo's large preset, on the training thread.
    """
    n = counts.shape[1]
    total = counts.sum(axis=1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = total / n
        p = counts / total
        # 0 * log 0 = 0
        entropy = -np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0).sum(axis=1)
        # One expert is trivially uniform; log(1) = 0 would divide by zero.
        entropy_frac = entropy / math.log(n) if n > 1 else np.ones(len(counts))
        imbalance = (counts.max(axis=1, keepdims=True) / mean)[:, 0]
        cv = (counts.std(axis=1, keepdims=True) / mean)[:, 0]
    empty = total[:, 0] <= 0
    return tuple(np.where(empty, np.nan, x) for x in (imbalance, cv, entropy_frac))  # type: ignore[return-value]


@dataclass
class _DeadWindow:
    """Per-expert token counts ``[layers, experts]`` of the last ``size`` flushed steps
    in which any of the layers had data.

    Keeps running sums (exact: counts are integers in float64), so each flush costs
    O(layers * experts), not O(window * layers * experts), for every layer at once.
    """

    size: int
    steps: deque[tuple[np.ndarray, np.ndarray]] = field(default_factory=deque)
    total: np.ndarray | None = None
    seen: np.ndarray | None = None  # per layer: steps in the window it had data in

    def push(self, counts: np.ndarray, had_data: np.ndarray) -> None:
        counts = np.where(had_data[:, None], counts, 0.0)
        had = had_data.astype(np.int64)
        if self.total is None or self.total.shape != counts.shape:
            self.steps.clear()
            self.total = np.zeros_like(counts)
            self.seen = np.zeros(len(counts), dtype=np.int64)
        assert self.seen is not None
        if len(self.steps) == self.size:
            old, old_had = self.steps.popleft()
            self.total -= old
            self.seen -= old_had
        self.steps.append((counts, had))
        self.total += counts
        self.seen += had

    def dead(self) -> np.ndarray:
        """Per layer: experts that received no token in any step of the window."""
        assert self.total is not None
        return (self.total == 0).sum(axis=1)


@dataclass
class _WidthGroup:
    """The MoE layers of every rank with one expert count: derived together from one
    stacked array."""

    keys: tuple[str, ...]  # each layer's token-count key
    names: list[tuple[str, ...]]  # each layer's derived names, in derive's table order
    window: _DeadWindow


def _width_groups(specs: dict[int, MetricSpec], dead_window: int) -> list[_WidthGroup]:
    """The derive tables of the token-count metrics ``specs`` (layer -> spec), by width."""
    by_width: dict[int, list[MetricSpec]] = {}
    for spec in specs.values():
        by_width.setdefault(spec.size, []).append(spec)
    return [
        _WidthGroup(
            tuple(spec.key for spec in group),
            [tuple(f"{AREA}/{spec.scope}/{name}" for name in DERIVED) for spec in group],
            _DeadWindow(dead_window),
        )
        for group in by_width.values()
    ]


@dataclass
class _RouterLayer:
    """One router this rank holds: its site and the slots its hook records into."""

    site: RouterSite
    tokens: Slot
    zloss: Slot
    mass: Slot


class MoEMonitor:
    """Router load balance, z-loss, top-k mass and dead experts of every MoE layer.

    ``every``: record every N steps. ``dead_window``: an expert is dead when it received
    no token in the last ``dead_window`` flushed steps with data (before that many steps
    were seen, over the steps seen so far; ``monitors/global/moe_dead_window_steps_count``
    says how many).
    """

    name = "moe"

    def __init__(self, every: int = 1, dead_window: int = 100, launch: str | None = None) -> None:
        if dead_window < 1:
            raise ValueError(f"dead_window must be >= 1, got {dead_window}")
        self.every = check_every(every)
        self.active = True
        self.dead_window = dead_window
        self.launch = launch_mode(launch)  # "grouped": syncless.monitors.layer_batch
        self._layers: list[_RouterLayer] = []
        self._groups: list[_WidthGroup] = []
        self._batch: LayerBatch | None = None

    def nothing_to_watch(self, model: ModelMap) -> str | None:
        """Why this model gives the monitor nothing to record, or None."""
        return None if model.routers else "no MoE router: a dense model"

    def prepare(self, ctx: MonitorContext) -> None:
        for site in ctx.model.routers:
            if site.score not in SCORES:
                raise ValueError(
                    f"MoE monitor: layer {site.layer}'s router scores with {site.score!r}; "
                    f"supported: {', '.join(SCORES)}"
                )
            if not 1 <= site.top_k <= site.n_experts:
                raise ValueError(
                    f"MoE monitor: layer {site.layer}'s router has top_k={site.top_k} for "
                    f"{site.n_experts} experts"
                )
            declare = ctx.metrics.declare
            self._layers.append(
                _RouterLayer(
                    site,
                    tokens=declare(
                        AREA,
                        TOKENS,
                        "sum",
                        size=site.n_experts,
                        layer=site.layer,
                        element="expert",
                    ),
                    zloss=declare(AREA, "moe_router_zloss", "mean", layer=site.layer),
                    mass=declare(AREA, "moe_topk_prob_mass", "mean", layer=site.layer),
                )
            )

    def attach(self, ctx: MonitorContext) -> None:
        buffer = ctx.metrics.buffer
        if buffer is None:
            raise RuntimeError("MoE monitor: attach() before the metric set's allocate()")
        # Derived over every rank's MoE layers (the allocated union): pipeline stages
        # hold other layers, and rank 0 derives for all of them.
        self._groups = _width_groups(ctx.metrics.layer_specs(AREA, TOKENS), self.dead_window)
        groups: dict[int, SlotGroup] = {}
        for layer in self._layers:
            groups[layer.site.layer] = group = SlotGroup(
                ctx.metrics, [Column(layer.tokens), Column(layer.zloss), Column(layer.mass)]
            )
            if layer.site.routing_map:
                hook = ctx.timed(self.name, self._make_routing_hook(layer, group))
                ctx.handles += layer.site.attach_routing(hook)
                continue
            one = torch.ones((), dtype=torch.float64, device=buffer.device)
            hook = ctx.timed(self.name, self._make_logits_hook(layer, one, group))
            ctx.handles += layer.site.attach_logits(hook)
        # Routers that hand over their own choice record through the torch path: the
        # grouped kernel recomputes a top-k.
        by_logits = [r for r in self._layers if not r.site.routing_map]
        shapes = {(r.site.n_experts, r.site.top_k, r.site.score) for r in by_logits}
        if self.launch == "grouped" and len(shapes) == 1:  # one kernel for every router
            _, top_k, score = shapes.pop()
            softmax = score == "softmax"

            def single(index: int, logits: torch.Tensor) -> None:
                group = groups[index]
                partials = kernels.router_partials(logits, top_k, softmax, group.kernel_gate)
                group.fold(partials, logits.shape[0])

            self._batch = LayerBatch(
                [r.site.layer for r in by_logits],
                SlotGroup(
                    ctx.metrics,
                    [Column(slot) for r in by_logits for slot in (r.tokens, r.zloss, r.mass)],
                ),
                view=lambda logits: (logits,),
                grouped=lambda logits, offsets, n, gate: kernels.router_partials_grouped(
                    logits, offsets, n, top_k, softmax, gate
                ),
                single=single,
                device=buffer.device,
                samples=lambda logits: logits.shape[0],
                defer_fold=True,  # nothing reads these slots before the flush
            )
            ctx.batches.append(self._batch)

    def _make_logits_hook(self, layer: _RouterLayer, one: torch.Tensor, group: SlotGroup):
        top_k, score = layer.site.top_k, layer.site.score
        tokens, zloss, mass = layer.tokens, layer.zloss, layer.mass
        softmax = score == "softmax"
        index = layer.site.layer

        @hot_path
        def record(logits: torch.Tensor) -> None:
            if not self.active and not capturing(logits.is_cuda):
                return
            n_tokens = logits.shape[0]  # a shape, fixed by the batch: not a tensor value
            if kernels.use_triton(logits) and kernels.router_supported(logits.shape[-1]):
                if self._batch is not None:
                    self._batch.add(index, logits)  # the site's hook detached it
                    return
                partials = kernels.router_partials(logits, top_k, softmax, group.kernel_gate)
                group.fold(partials, n_tokens)
                return
            stats = router_stats(logits, top_k, score, one)
            tokens.add(stats.counts, count=n_tokens)
            zloss.add(stats.zloss_sum, count=n_tokens)
            mass.add(stats.mass_sum, count=n_tokens)

        return record

    def _make_routing_hook(self, layer: _RouterLayer, group: SlotGroup):
        tokens, zloss, mass = layer.tokens, layer.zloss, layer.mass
        score = layer.site.score

        @hot_path
        def record(logits: torch.Tensor, routing_map: torch.Tensor) -> None:
            if not self.active and not capturing(logits.is_cuda):
                return
            n_tokens = logits.shape[0]  # a shape, fixed by the batch: not a tensor value
            stats = router_stats_from_map(logits, routing_map, score)
            if kernels.use_triton(logits):  # one fold for the three slots, not six ops
                partials = torch.cat(
                    [stats.counts.float(), stats.zloss_sum.view(1), stats.mass_sum.view(1)]
                )
                group.fold(partials.view(1, -1), n_tokens)
                return
            tokens.add(stats.counts, count=n_tokens)
            zloss.add(stats.zloss_sum, count=n_tokens)
            mass.add(stats.mass_sum, count=n_tokens)

        return record

    def derive(self, readout: Readout) -> dict[str, float]:
        out: dict[str, float] = {}
        imbalances: list[np.ndarray] = []
        dead_total, window_steps = 0, []
        for group in self._groups:
            counts, present = readout.stack(group.keys)  # cluster-wide
            full = present.all(axis=1)  # a layer no forward recorded in this step is skipped
            if not full.any():
                continue
            group.window.push(counts, full)
            rows = np.flatnonzero(full)
            stats = load_stats_rows(counts[rows])
            dead = group.window.dead()[rows]
            table = np.stack([*stats, dead], axis=1).astype(np.float64)
            names = [name for r in rows.tolist() for name in group.names[r]]
            out.update(zip(names, table.ravel().tolist(), strict=True))
            imbalances.append(stats[0])
            dead_total += int(dead.sum())
            assert group.window.seen is not None
            window_steps.append(int(group.window.seen[rows].min()))
        if imbalances:
            every = np.concatenate(imbalances)
            out[f"{AREA}/global/moe_imbalance_mean"] = float(np.mean(every))
            out[f"{AREA}/global/moe_imbalance_max"] = float(np.max(every))
            out[f"{AREA}/global/moe_dead_experts_count"] = float(dead_total)
            # How much history the dead-expert counts rest on (< dead_window early on).
            out[f"{AREA}/global/moe_dead_window_steps_count"] = float(min(window_steps))
        return out

    def close(self) -> None:
        pass
