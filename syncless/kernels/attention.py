"""Per-head max QK logit and softmax row entropy in one pass, never materialising logits.

One program per (block of ``BLOCK_M`` query rows, batch x head) walks the keys in blocks
of ``BLOCK_N`` like a flash-attention forward without the ``P @ V``: per row it keeps the
running max ``m``, ``S = Σ exp(l - m)`` and ``T = Σ exp(l - m) (l - m)``, rescaled when
``m`` grows (``T' = α (T + (m - m') S)``, ``α = exp(m - m')``), so the entropy is
``ln S - T / S`` at the end. Causal (bottom-right aligned) and sliding-window masks are
applied per block and key blocks nobody may see are skipped.

Partials ``[B * n_row_blocks, 2H + 1]``: per-head max logit, per-head entropy sum (times
``weight``, the sampled mode's Horvitz-Thompson factor) and, in the last column, the
number of query rows the block used (written by head 0 only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from syncless.hot_path import hot_path
from syncless.kernels import interpreting
from syncless.kernels.launch import cached_launch

_BLOCK_M = 64
_BLOCK_N = 64


@triton.jit
def _qk_block(
    q_ptr, k_ptr, out_row, rb, b, h,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd,
    H, GROUP, N_ROWS, Q_LEN, K_LEN, WINDOW,
    scale, weight, phase, stride,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Row block ``rb`` of sequence ``b``, head ``h``: writes its partials at ``out_row``."""
    kvh = h // GROUP
    j = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = j < N_ROWS
    qpos = phase + stride * j
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_base = q_ptr + b.to(tl.int64) * sqb + h.to(tl.int64) * sqh
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
    hi = K_LEN
    if CAUSAL:
        hi = tl.minimum(K_LEN, phase + stride * last_row + (K_LEN - Q_LEN) + 1)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, phase + stride * first_row + (K_LEN - Q_LEN) - WINDOW + 1)
        lo = (lo // BLOCK_N) * BLOCK_N

    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    s_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    t_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = k_ptr + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < K_LEN
        kb = tl.load(
            k_base + n[:, None].to(tl.int64) * skn + d[None, :] * skd,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            kb = kb.to(tl.float32)
        logits = tl.dot(q, tl.trans(kb), input_precision=PRECISION) * scale
        allowed = row_ok[:, None] & n_ok[None, :]
        if CAUSAL:
            allowed = allowed & (n[None, :] <= kpos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (kpos[:, None] - n[None, :] < WINDOW)
        logits = tl.where(allowed, logits, float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, axis=1))
        # A row that has seen no allowed key yet keeps m = -inf: shift by 0 instead, so
        # no -inf - -inf = nan appears; its S and T stay 0.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        shift = tl.where(s_sum > 0, (m - m_ref) * s_sum, 0.0)
        p = tl.exp(logits - m_ref[:, None])
        centred = tl.where(allowed, p * (logits - m_ref[:, None]), 0.0)
        t_sum = alpha * (t_sum + shift) + tl.sum(centred, axis=1)
        s_sum = alpha * s_sum + tl.sum(p, axis=1)
        m = m_new

    entropy = tl.where(row_ok, tl.log(s_sum) - t_sum / s_sum, 0.0)
    tl.store(out_row + h, tl.max(tl.where(row_ok, m, float("-inf")), axis=0))
    tl.store(out_row + H + h, tl.sum(entropy, axis=0) * weight)
    tl.store(out_row + 2 * H, tl.sum(row_ok.to(tl.float32), axis=0), mask=h == 0)


# Batch-dependent sizes and the rotating phase are not specialised: Triton would
# compile a new variant (~100 ms, seen on the H200) for phase == 1 or a size that is a
# multiple of 16 the first time one appears, in the middle of training.
@cached_launch
@triton.jit(do_not_specialize=["N_ROWS", "Q_LEN", "K_LEN", "N_RB", "WINDOW", "phase", "stride"])
def _qk_stats_kernel(
    q_ptr, k_ptr, out_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd,
    H, GROUP, N_ROWS, Q_LEN, K_LEN, N_RB, WINDOW,
    scale, weight, phase, stride,
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
        H, GROUP, N_ROWS, Q_LEN, K_LEN, WINDOW, scale, weight, phase, stride,
        HEAD_DIM, CAUSAL, HAS_WINDOW, PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_D,
    )  # fmt: skip


@cached_launch
@triton.jit(do_not_specialize=["N_ROWS", "Q_LEN", "K_LEN", "N_RB", "WINDOW"])
def _qk_stats_grouped_kernel(
    q_ptr, k_ptr, offsets_ptr, out_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd,
    H, GROUP, N_ROWS, Q_LEN, K_LEN, N_RB, WINDOW, L, OUT_STRIDE,
    scale,
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
        H, GROUP, N_ROWS, Q_LEN, K_LEN, WINDOW, scale, 1.0, 0, 1,
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
        float(scale), float(weight), phase, stride,
        HEAD_DIM=head_dim, CAUSAL=causal, HAS_WINDOW=window is not None,
        PRECISION=precision, UPCAST=upcast, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
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
        float(scale),
        HEAD_DIM=head_dim, CAUSAL=causal, HAS_WINDOW=window is not None,
        PRECISION=precision, UPCAST=upcast, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
    )  # fmt: skip
    return out
