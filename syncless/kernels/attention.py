"""Per-head max QK logit and softmax row entropy in one pass, never materialising logits.

One program per (block of ``BLOCK_M`` query rows, batch x head) walks the keys in blocks
of ``BLOCK_N`` like a flash-attention forward without the ``P @ V``. It works in base 2
(logits times ``scale * log2 e``, ``exp2``): per row it keeps the running max ``m``,
``S = Σ 2^(l - m)`` and ``T = Σ 2^(l - m) (l - m)``, rescaled when ``m`` grows
(``T' = α (T + (m - m') S)``, ``α = 2^(m - m')``). ``S`` is the natural-base sum and
``T`` is ``log2 e`` times the natural-base one, so at the end the max logit is
``m ln 2`` and the entropy in nats ``ln S - ln 2 · T / S``.

Key blocks that every row of the block may see in full (before the causal diagonal,
inside ``K_LEN``, no sliding window) are updated without masks; only the rest (the
diagonal, a ragged tail, every block under a sliding window) pays for them. Key blocks
nobody may see are skipped.

Partials ``[B * n_row_blocks, 2H + 1]``: per-head max logit, per-head entropy sum (times
``weight``, the sampled mode's Horvitz-Thompson factor) and, in the last column, the
number of query rows the block used (written by head 0 only).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from syncless.hot_path import hot_path
from syncless.kernels import interpreting

# H200, 24 layers of B=8, H=16, L=1024, D=64, causal, bf16 in one grouped launch (the
# demo's "large" shape): 2.80 ms at 64 x 64 with 4 warps, 2.45 ms at 128 x 32 with 8
# warps (a config sweep), 1.51 ms with base 2 and the unmasked blocks as well
# (bench/RESULTS.md, monitor_kernels, fb3e2cf).
_BLOCK_M = 128
_BLOCK_N = 32
_NUM_WARPS = 8
_LOG2E = math.log2(math.e)
_LN2: tl.constexpr = tl.constexpr(math.log(2.0))


@triton.jit
def _k_logits(
    q, k_base, start, K_LEN, skn, skd, d, d_ok, scale2,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    """Base-2 logits ``[BLOCK_M, BLOCK_N]`` of the keys from ``start``; ``TAIL``: some
    may lie at or past ``K_LEN`` (loaded as zeros)."""
    n = start + tl.arange(0, BLOCK_N)
    mask = d_ok[None, :]
    if TAIL:
        mask = mask & (n < K_LEN)[:, None]
    kb = tl.load(k_base + n[:, None].to(tl.int64) * skn + d[None, :] * skd, mask=mask, other=0.0)
    if UPCAST:
        kb = kb.to(tl.float32)
    return tl.dot(q, tl.trans(kb), input_precision=PRECISION) * scale2


@triton.jit
def _qk_block(
    q_ptr, k_ptr, out_row, rb, b, h,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd,
    H, GROUP, N_ROWS, Q_LEN, K_LEN, WINDOW,
    scale2, weight, phase, stride,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Row block ``rb`` of sequence ``b``, head ``h``: writes its partials at ``out_row``.
    ``scale2`` is the softmax scale times ``log2 e``."""
    kvh = h // GROUP
    j = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = j < N_ROWS
    qpos = phase + stride * j
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_base = q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
    # Rows past N_ROWS load zeros: finite logits in the unmasked blocks, dropped at the end.
    q = tl.load(
        q_base + qpos[:, None].to(tl.int64) * sqm + d[None, :] * sqd,
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    # Bottom-right alignment: query i sits at key position i + K_LEN - Q_LEN.
    kpos = qpos + (K_LEN - Q_LEN)
    first_row = rb * BLOCK_M
    last_row = tl.minimum(first_row + BLOCK_M, N_ROWS) - 1
    # Keys [lo, mid) are allowed for every row of the block (no masks there), [mid, hi)
    # for some.
    hi = K_LEN
    mid = K_LEN
    if CAUSAL:
        hi = tl.minimum(K_LEN, phase + stride * last_row + (K_LEN - Q_LEN) + 1)
        # Up to the first row's own position; at least 0 (more queries than keys), so
        # no block starts at a negative key.
        mid = tl.maximum(0, tl.minimum(K_LEN, phase + stride * first_row + (K_LEN - Q_LEN) + 1))
    mid = (mid // BLOCK_N) * BLOCK_N
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, phase + stride * first_row + (K_LEN - Q_LEN) - WINDOW + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
        # Every block masked: only a window wider than about BLOCK_M + BLOCK_N keys
        # leaves a whole block inside it for every row.
        mid = lo

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    s_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    t_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = k_ptr + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
    for start in range(lo, mid, BLOCK_N):
        logits = _k_logits(q, k_base, start, K_LEN, skn, skd, d, d_ok, scale2,
                           PRECISION, UPCAST, BLOCK_N, False)  # fmt: skip
        # Every logit is finite, so is m_new; only the first block's m = -inf with
        # S = 0 needs the (per-row, cheap) guard against -inf * 0.
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        alpha = tl.exp2(m - m_new)
        shift = tl.where(s_sum > 0, (m - m_new) * s_sum, 0.0)
        centred = logits - m_new[:, None]
        p = tl.exp2(centred)
        t_sum = alpha * (t_sum + shift) + tl.sum(p * centred, axis=1)
        s_sum = alpha * s_sum + tl.sum(p, axis=1)
        m = m_new
    for start in range(mid, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        logits = _k_logits(q, k_base, start, K_LEN, skn, skd, d, d_ok, scale2,
                           PRECISION, UPCAST, BLOCK_N, True)  # fmt: skip
        allowed = row_ok[:, None] & (n < K_LEN)[None, :]
        if CAUSAL:
            allowed = allowed & (n[None, :] <= kpos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (kpos[:, None] - n[None, :] < WINDOW)
        logits = tl.where(allowed, logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        # A row that has seen no allowed key yet keeps m = -inf: shift by 0 instead, so
        # no -inf - -inf = nan appears; its S and T stay 0.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_ref)
        shift = tl.where(s_sum > 0, (m - m_ref) * s_sum, 0.0)
        centred = logits - m_ref[:, None]
        p = tl.exp2(centred)
        t_sum = alpha * (t_sum + shift) + tl.sum(tl.where(allowed, p * centred, 0.0), axis=1)
        s_sum = alpha * s_sum + tl.sum(p, axis=1)
        m = m_new

    entropy = tl.where(row_ok, tl.log(s_sum) - _LN2 * t_sum / s_sum, 0.0)
    tl.store(out_row + h, tl.max(tl.where(row_ok, m, float("-inf")), axis=0) * _LN2)
    tl.store(out_row + H + h, tl.sum(entropy, axis=0) * weight)
    tl.store(out_row + 2 * H, tl.sum(row_ok.to(tl.float32), axis=0), mask=h == 0)


# Batch-dependent sizes and the rotating phase are not specialised: Triton would
# compile a new variant (~100 ms, seen on the H200) for phase == 1 or a size that is a
# multiple of 16 the first time one appears, in the middle of training.
@triton.jit(do_not_specialize=["N_ROWS", "Q_LEN", "K_LEN", "N_RB", "WINDOW", "phase", "stride"])
def _qk_stats_kernel(
    q_ptr, k_ptr, out_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd,
    H, GROUP, N_ROWS, Q_LEN, K_LEN, N_RB, WINDOW,
    scale2, weight, phase, stride,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    rb = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    out_row = out_ptr + (b * N_RB + rb).to(tl.int64) * (2 * H + 1)
    _qk_block(
        q_ptr, k_ptr, out_row, rb, b, h, sqb, sqh, sqm, sqd, skb, skh, skn, skd,
        H, GROUP, N_ROWS, Q_LEN, K_LEN, WINDOW, scale2, weight, phase, stride,
        HEAD_DIM, CAUSAL, HAS_WINDOW, PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip


@triton.jit(do_not_specialize=["N_ROWS", "Q_LEN", "K_LEN", "N_RB", "WINDOW"])
def _qk_stats_grouped_kernel(
    q_ptr, k_ptr, offsets_ptr, out_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd,
    H, GROUP, N_ROWS, Q_LEN, K_LEN, N_RB, WINDOW, L, OUT_STRIDE,
    scale2,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Every row (exact mode) of layer ``program_id(2)``: its q at ``offsets[layer]`` and
    its k at ``offsets[L + layer]`` elements from ``q_ptr`` / ``k_ptr``; its ``2H + 1``
    columns at ``layer * (2H + 1)`` of ``out`` ``[B * N_RB, L * (2H + 1)]``."""
    rb = tl.program_id(0)
    bh = tl.program_id(1)
    layer = tl.program_id(2)
    b = bh // H
    h = bh % H
    q_base = q_ptr + tl.load(offsets_ptr + layer)
    k_base = k_ptr + tl.load(offsets_ptr + L + layer)
    out_row = out_ptr + (b * N_RB + rb).to(tl.int64) * OUT_STRIDE + layer.to(tl.int64) * (2 * H + 1)
    _qk_block(
        q_base, k_base, out_row, rb, b, h, sqb, sqh, sqm, sqd, skb, skh, skn, skd,
        H, GROUP, N_ROWS, Q_LEN, K_LEN, WINDOW, scale2, 1.0, 0, 1,
        HEAD_DIM, CAUSAL, HAS_WINDOW, PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip


@hot_path
def qk_stats_partials(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    causal: bool,
    window: int | None,
    phase: int = 0,
    stride: int = 1,
    weight: float = 1.0,
) -> torch.Tensor:
    """Partials ``[B * ceil(n / BLOCK_M), 2H + 1]`` for query rows ``phase::stride``.

    ``q`` ``[B, H, Lq, D]`` (any strides), ``k`` ``[B, Hkv, Lk, D]``, ``H % Hkv == 0``.
    """
    b, h, q_len, head_dim = q.shape
    hkv, k_len = k.shape[1], k.shape[2]
    n_rows = (q_len - phase + stride - 1) // stride
    n_rb = triton.cdiv(n_rows, _BLOCK_M)
    out = torch.empty((b * n_rb, 2 * h + 1), dtype=torch.float32, device=q.device)
    # fp32 inputs: full-precision dot products (the torch path's baddbmm does not use
    # TF32 by default); bf16/fp16 products are exact in the fp32 accumulator anyway.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # The CPU interpreter (CI) multiplies bfloat16 bit patterns as integers: upcast there.
    upcast = interpreting() and q.dtype == torch.bfloat16
    if upcast:
        precision = "ieee"
    _qk_stats_kernel[(n_rb, b * h)](
        q, k, out, *q.stride(), *k.stride(),
        h, h // hkv, n_rows, q_len, k_len, n_rb, window or 0,
        float(scale) * _LOG2E, float(weight), phase, stride,
        HEAD_DIM=head_dim, CAUSAL=causal, HAS_WINDOW=window is not None,
        PRECISION=precision, UPCAST=upcast, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=_NUM_WARPS,
    )  # fmt: skip
    return out


@hot_path
def qk_stats_partials_grouped(
    q: torch.Tensor,
    k: torch.Tensor,
    offsets: torch.Tensor,
    n_layers: int,
    scale: float,
    causal: bool,
    window: int | None,
) -> torch.Tensor:
    """Partials ``[B * ceil(Lq / BLOCK_M), L * (2H + 1)]`` of ``L`` layers, every query
    row (exact mode), in one launch: ``q``/``k`` are layer 0's, layer ``l``'s sit at
    ``offsets[l]`` / ``offsets[L + l]`` elements from them with the same shapes, dtypes
    and strides."""
    b, h, q_len, head_dim = q.shape
    hkv, k_len = k.shape[1], k.shape[2]
    n_rb = triton.cdiv(q_len, _BLOCK_M)
    width = 2 * h + 1
    out = torch.empty((b * n_rb, n_layers * width), dtype=torch.float32, device=q.device)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    upcast = interpreting() and q.dtype == torch.bfloat16
    if upcast:
        precision = "ieee"
    _qk_stats_grouped_kernel[(n_rb, b * h, n_layers)](
        q, k, offsets, out, *q.stride(), *k.stride(),
        h, h // hkv, q_len, q_len, k_len, n_rb, window or 0, n_layers, n_layers * width,
        float(scale) * _LOG2E,
        HEAD_DIM=head_dim, CAUSAL=causal, HAS_WINDOW=window is not None,
        PRECISION=precision, UPCAST=upcast, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), num_warps=_NUM_WARPS,
    )  # fmt: skip
    return out
