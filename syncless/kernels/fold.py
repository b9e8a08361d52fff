"""One launch that folds a module's partial results into several metric slots.

``partials`` is ``[P, N]`` float32: ``P`` partial rows (one per program of the partials
kernel) of ``N`` columns. ``table`` is ``[5, N]`` int64, per column the buffer index of
its sum (or -1), of its count (or -1), of its running max (or -1), of a "first step"
min metric (or -1), and of its gate in ``gates``, built once by
:class:`syncless.metrics.SlotGroup`. A column with a sum target is reduced over ``P`` by
a float64 sum (and, if it also has a max target, that sum is what the max sees: a
per-call count feeding a "largest this step" alert, which several columns may share:
an atomic max, for non-negative values only); a column with only a max target is
reduced by max. A column whose gate (float64 0/1) is 0 leaves every target untouched,
as the torch slot ops do; when every column's is 0 the program returns before reading
the partials, which a gated partials kernel then left unwritten (inside a CUDA graph
both kernels run at every replay, and the gates decide). A column with a first-step target
whose sum is positive writes the current step label (``step``, a float64 device
scalar) into it as a min: the step of the first NaN/Inf a layer saw since the last
readout, kept on the device (no host read) at no launch more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from syncless.hot_path import hot_path

_BLOCK_N = 128
# Partials per tile (rows x columns). Few columns get taller tiles: the nonfinite
# alarm's fold of 12 layers read [P, 12] 16 rows at a time in one program, 58 us of a
# qwen3-1.7b step on the H200 (bench/RESULTS.md, stack_profile at d8c6cb4).
_TILE = 2048


# Sizes that change with the batch are not specialised (Triton would compile a variant
# for a value of 1 or a multiple of 16 the first time it sees one, mid-run: ~100 ms).
@triton.jit(do_not_specialize=["P"])
def _fold_kernel(
    part_ptr,
    table_ptr,
    buf_ptr,
    gates_ptr,
    step_ptr,
    P,
    N,
    n_samples,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_range = cols < N
    sum_idx = tl.load(table_ptr + cols, mask=in_range, other=-1)
    cnt_idx = tl.load(table_ptr + N + cols, mask=in_range, other=-1)
    max_idx = tl.load(table_ptr + 2 * N + cols, mask=in_range, other=-1)
    first_idx = tl.load(table_ptr + 3 * N + cols, mask=in_range, other=-1)
    gate_idx = tl.load(table_ptr + 4 * N + cols, mask=in_range, other=0)
    gate = tl.load(gates_ptr + gate_idx, mask=in_range, other=0.0)
    if tl.max(gate, axis=0) == 0.0:
        return
    on = gate != 0.0
    acc_sum = tl.zeros([BLOCK_N], dtype=tl.float64)
    acc_max = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        m = (rows[:, None] < P) & in_range[None, :]
        v = tl.load(part_ptr + rows[:, None] * N + cols[None, :], mask=m, other=0.0)
        acc_sum += tl.sum(v.to(tl.float64), axis=0)
        acc_max = tl.maximum(acc_max, tl.max(tl.where(m, v, float("-inf")), axis=0))

    # Masked by the gate, not multiplied: a column that is off must not turn the sum
    # into NaN from partials a gated kernel never wrote.
    has_sum = on & (sum_idx >= 0)
    s_ptr = buf_ptr + tl.where(has_sum, sum_idx, 0)
    tl.store(s_ptr, tl.load(s_ptr, mask=has_sum, other=0.0) + acc_sum, mask=has_sum)

    has_cnt = on & (cnt_idx >= 0)
    c_ptr = buf_ptr + tl.where(has_cnt, cnt_idx, 0)
    tl.store(c_ptr, tl.load(c_ptr, mask=has_cnt, other=0.0) + n_samples, mask=has_cnt)

    has_max = in_range & (max_idx >= 0)
    m_ptr = buf_ptr + tl.where(has_max, max_idx, 0)
    own = on & has_max & (sum_idx < 0)  # a max column: its target is its own
    old = tl.load(m_ptr, mask=own, other=0.0)
    tl.store(m_ptr, tl.maximum(old, acc_max.to(tl.float64)), mask=own)
    # also_max: several columns may feed one target (the nonfinite alert over every
    # layer of a grouped fold), from other programs too, so an atomic max. The values
    # are sums of counts (>= 0), and for non-negative doubles and the -inf identity the
    # int64 bit patterns order as the values do.
    shared = on & has_max & (sum_idx >= 0)
    tl.atomic_max(
        m_ptr.to(tl.pointer_type(tl.int64)), acc_sum.to(tl.int64, bitcast=True), mask=shared
    )
    # first step: a min metric, stored negated (a max of -step). Each column has its own
    # target (SlotGroup checks), so a plain load and store.
    has_first = on & (first_idx >= 0) & (acc_sum > 0)
    f_ptr = buf_ptr + tl.where(has_first, first_idx, 0)
    neg_step = -tl.load(step_ptr)
    old_first = tl.load(f_ptr, mask=has_first, other=0.0)
    tl.store(f_ptr, tl.maximum(old_first, neg_step), mask=has_first)


@hot_path
def fold(
    partials: torch.Tensor,
    table: torch.Tensor,
    buffer: torch.Tensor,
    gates: torch.Tensor,
    step: torch.Tensor,
    n_samples: float,
) -> None:
    """Reduce ``partials`` ``[P, N]`` over P and fold them into ``buffer`` (1 launch);
    ``gates``: the metric set's float64 flags, which ``table``'s last row indexes."""
    n_cols = table.shape[1]
    block_n = min(_BLOCK_N, max(16, triton.next_power_of_2(n_cols)))
    grid = (triton.cdiv(n_cols, block_n),)
    # n_samples as a float: an int argument would be specialised (== 1, % 16) and
    # recompile the kernel for a few batch sizes.
    _fold_kernel[grid](
        partials, table, buffer, gates, step, partials.shape[0], n_cols, float(n_samples),
        BLOCK_P=_TILE // block_n, BLOCK_N=block_n,
    )  # fmt: skip
