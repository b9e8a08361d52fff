"""Per-head attention statistics of one (q, k) pair, and the per-shape plans they use.

``qk_stats`` turns the post-RoPE queries and keys of one attention forward into two
per-head vectors: the max of the scaled logits ``q·k * scale`` over every allowed
(query, key) pair, and the *sum* over query rows of the softmax row entropy
``-Σ_j p_ij ln p_ij`` (nats). Device ops only, fixed shapes, no branch on a value.

Cost control (see docs/monitors/attention.md): the logits of the rows used are
materialised as one ``[B, H, n, Lk]`` float32 tensor. When ``B * H * Lq * Lk`` exceeds
``max_elements``, only every ``stride``-th query row is used (``row_stride``), with a
phase that the caller rotates from call to call so that ``stride`` consecutive calls of
one shape use every row exactly once.

A :class:`RowPlan` holds what depends only on static shapes (stride, masks, constants)
and is built once per shape by :class:`PlanCache`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from syncless.hot_path import hot_path

DEFAULT_MAX_ELEMENTS = 2**24
# The fused kernel keeps no logits: its budget bounds time, and the handle's overhead
# budget already sets the cadence, so the default is exact (see AttentionMonitor).
DEFAULT_FUSED_MAX_ELEMENTS = 2**40
# Distinct (batch, heads, lengths, mask, device) shapes kept; a model sees a handful
# (train / eval batch, last short batch), variable-length batching a few more.
PLAN_CACHE_SIZE = 32


def row_stride(batch: int, n_heads: int, q_len: int, k_len: int, max_elements: int) -> int:
    """Every how many query rows one is used so that ``B * H * n * Lk <= max_elements``.

    1 (exact) when the full logits fit. Otherwise the smallest stride whose row count
    ``ceil(q_len / stride)`` fits; at least one row per sequence is always used, so a
    budget below ``B * H * Lk`` is exceeded (one row of keys cannot be split).
    """
    if batch * n_heads * q_len * k_len <= max_elements:
        return 1
    rows = max(1, max_elements // (batch * n_heads * k_len))
    return -(-q_len // rows)


def check_lengths(q_len: int, k_len: int, causal: bool) -> None:
    """Causal attention needs at least as many keys as queries (host ints only)."""
    if causal and q_len > k_len:
        raise ValueError(
            f"causal attention with {q_len} queries but {k_len} keys: syncless aligns the "
            "causal mask bottom-right (the last query sees every key), which leaves the "
            "first queries without any key"
        )


def rows_at_phase(q_len: int, stride: int, phase: int) -> int:
    """How many of the rows ``phase, phase + stride, ...`` are below ``q_len``."""
    return (q_len - phase + stride - 1) // stride


@dataclass
class RowPlan:
    """What one shape needs, built once (a few small device ops) and reused.

    ``mask``: the disallowed (query, key) pairs of the exact path, ``[Lq, Lk]`` bool,
    None when nothing is masked. ``offsets``: for the sampled path with a mask,
    ``E[j, key] = stride * j + (Lk - Lq) - key`` (int32, ``[rows, Lk]``), so that at
    phase ``r`` sampled row ``j`` (query ``r + stride * j``) may see ``key`` iff
    ``0 <= E + r`` (and ``E + r < window``). ``used_rows``: float64 device scalars
    ``B * rows`` and ``B * (rows - 1)``, the rows a call uses (index ``rows - n``).
    """

    stride: int
    rows: int
    causal: bool
    window: int | None
    mask: torch.Tensor | None
    offsets: torch.Tensor | None
    used_rows: torch.Tensor

    @hot_path
    def sampled_mask(self, phase: int | torch.Tensor, n_rows: int) -> torch.Tensor | None:
        """Disallowed pairs of the rows used at ``phase`` (1 kernel; 3 with a window)."""
        if self.offsets is None:
            return None
        e = self.offsets[:n_rows]  # a view: rows beyond n_rows are not used at this phase
        disallowed = e < -phase
        if self.window is not None:
            disallowed = disallowed.logical_or(e >= self.window - phase)
        return disallowed


def build_plan(
    batch: int,
    n_heads: int,
    q_len: int,
    k_len: int,
    causal: bool,
    window: int | None,
    device: torch.device,
    max_elements: int,
) -> RowPlan:
    """The plan of one shape (runs once per shape; device ops only, no sync)."""
    check_lengths(q_len, k_len, causal)
    stride = row_stride(batch, n_heads, q_len, k_len, max_elements)
    rows = rows_at_phase(q_len, stride, 0)
    mask = offsets = None
    if causal:
        # Query position (bottom-right aligned: query i sits at key position
        # i + Lk - Lq) minus key position, for the rows of phase 0.
        key = torch.arange(k_len, device=device, dtype=torch.int32)
        pos = torch.arange(rows, device=device, dtype=torch.int32).mul_(stride)
        offsets = pos.add_(k_len - q_len)[:, None] - key[None, :]
        if stride == 1:
            mask = offsets < 0
            if window is not None:
                mask |= offsets >= window
            offsets = None
    used_rows = torch.arange(2, device=device, dtype=torch.float64).mul_(-batch).add_(batch * rows)
    return RowPlan(
        stride=stride,
        rows=rows,
        causal=causal,
        window=window,
        mask=mask,
        offsets=offsets,
        used_rows=used_rows,
    )


class PlanCache:
    """Row plans by shape, least recently used first out beyond ``capacity``.

    Shared by every layer of a monitor: layers of one model see the same shapes, so
    one causal mask serves them all.
    """

    def __init__(self, max_elements: int, capacity: int = PLAN_CACHE_SIZE) -> None:
        self.max_elements = max_elements
        self.capacity = capacity
        self._plans: OrderedDict[tuple, RowPlan] = OrderedDict()
        self.builds = 0

    def __len__(self) -> int:
        return len(self._plans)

    @hot_path
    def get(
        self,
        batch: int,
        n_heads: int,
        q_len: int,
        k_len: int,
        causal: bool,
        window: int | None,
        device: torch.device,
    ) -> RowPlan:
        if torch.compiler.is_compiling():
            # Traced: the plan's few ops go into the graph, and a cache the first call
            # fills would fail the graph's guard on the next (one recompile).
            return build_plan(
                batch, n_heads, q_len, k_len, causal, window, device, self.max_elements
            )
        key = (batch, n_heads, q_len, k_len, causal, window, device)
        plan = self._plans.get(key)
        if plan is None:
            plan = build_plan(
                batch, n_heads, q_len, k_len, causal, window, device, self.max_elements
            )
            self._plans[key] = plan
            self.builds += 1
            if len(self._plans) > self.capacity:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def clear(self) -> None:
        self._plans.clear()


@hot_path
def qk_stats(
    q: torch.Tensor, k: torch.Tensor, scale: float, disallowed: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head max scaled logit and summed row entropy of the rows in ``q``.

    ``q`` ``[B, H, n, D]`` (the query rows to use), ``k`` ``[B, Hkv, Lk, D]`` with
    ``H % Hkv == 0`` (query head ``h`` reads kv head ``h // (H // Hkv)``), ``disallowed``
    ``[n, Lk]`` bool or None. Returns two ``[H]`` tensors in the compute dtype (float32,
    or float64 for float64 inputs): ``max over (batch, row, allowed key)`` of ``q·k *
    scale`` and ``Σ over (batch, row)`` of ``-Σ_key p ln p``.

    Kernels: 1 matmul (the scale rides in its alpha), 1 masked_fill (if masked), 1 amax,
    1 softmax, 1 entr, 1 sum; plus 1 cast per input that is not float32/64.
    """
    b, h, n, d = q.shape
    hkv, k_len = k.shape[1], k.shape[2]
    group = h // hkv
    dtype = torch.promote_types(q.dtype, torch.float32)
    # GQA without repeating k: the `group` query heads of one kv head are consecutive, so
    # [B, H, n, D] is [B * Hkv, group * n, D] as a view (a copy only for strided rows).
    q3 = q.to(dtype).reshape(b * hkv, group * n, d)
    k3 = k.to(dtype).reshape(b * hkv, k_len, d)
    # beta=0 ignores the (uninitialised) input: one batched GEMM computes q·k * scale.
    logits = torch.baddbmm(q3.new_empty(()), q3, k3.transpose(1, 2), beta=0.0, alpha=scale)
    per_head = logits.view(b, hkv, group, n, k_len)
    if disallowed is not None:
        per_head.masked_fill_(disallowed, float("-inf"))
    qk_max = per_head.amax(dim=(0, 3, 4)).reshape(h)
    # entr(p) = -p ln p with entr(0) = 0: masked keys (p = 0) add nothing, no 0 * -inf.
    probs = torch.softmax(logits, dim=-1)
    torch.special.entr(probs, out=probs)  # in place: no third [B, H, n, Lk] tensor
    entropy_sum = probs.view(b, hkv, group, n, k_len).sum(dim=(0, 3, 4)).reshape(h)
    return qk_max, entropy_sum


@hot_path
def measure_sampled_traced(
    q: torch.Tensor, k: torch.Tensor, scale: float, plan: RowPlan
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sampled measurement under torch.compile: (per-head max logit, per-head
    entropy sum scaled to all rows, rows used), from a phase drawn on the device.

    Eager mode rotates the phase with a host counter, a Python int dynamo guards on: one
    graph per value, its recompile limit in 8 calls and the layer eager after that (the
    compiled step +22% to +54% on the H200, issue #20). A uniform random phase samples
    each row with probability 1/stride, so the sum scaled by stride stays unbiased.
    ``L // stride`` rows keep the shapes static; where ``L % stride`` rows are left
    over, those last rows are never sampled.
    """
    stride = plan.stride
    n_rows = q.shape[2] // stride
    phase = torch.randint(stride, (), device=q.device)
    index = torch.arange(n_rows, device=q.device) * stride + phase
    qk_max, entropy_sum = qk_stats(
        q.index_select(2, index), k, scale, plan.sampled_mask(phase, n_rows)
    )
    return qk_max, entropy_sum * stride, plan.used_rows[plan.rows - n_rows]
