"""Per-head max QK logit and softmax row entropy in one pass, never materialising logits.

One program per (block of ``BLOCK_M`` query rows, batch x head) walks the keys in blocks
of ``BLOCK_N`` like a flash-attention forward without the ``P @ V``. It works in base 2
(logits times ``scale * log2 e``, ``exp2``): per row it keeps the running max ``m``,
``S = Σ 2^(l - m)`` and ``T = Σ 2^(l - m) (l - m)``, rescaled when ``m`` grows
(``T' = α (T + (m - m') S)``, ``α = 2^(m - m')``). ``S`` is the natural-base sum and
``T`` is ``log2 e`` times the natural-base one, so at the end the max logit is
``m ln 2`` and the entropy in nats ``ln S - ln 2 · T / S``: one exponential per allowed
(query, key) pair and no logarithm, the floor of exact statistics next to the QK^T GEMM.

Precision: the logits are computed from q and k rounded to ``compute_dtype`` (what the
model's attention used: under bf16 autocast SDPA casts float32 q/k to bf16) with float32
accumulation on tensor cores. A float32 model without autocast gets TF32 when
``torch.get_float32_matmul_precision()`` allows it and three-pass TF32 (float32-accurate)
otherwise: never the plain float32 dot, which on the H200 ran 234x slower than bf16
(34.5 ms against 0.169 ms for B 4, 16 heads, L 2048, head_dim 128; shared/NOTES.md).

Rotary position embedding (``q_rope=(cos, sin)``): q may come *before* its rotation, in
the rotate-half convention of Hugging Face's ``apply_rotary_pos_emb``; each program
rotates its ``BLOCK_M`` query rows once, in float32, then rounds them to
``compute_dtype``, as the model's float32 rotation followed by SDPA's cast does. Keys are
rotated by :func:`syncless.kernels.rope.rotate` beforehand (rotating a key block here
would redo it for every query block).

Key blocks that every row of the block may see in full (before the causal diagonal,
inside ``K_LEN``, inside every row's sliding window) are updated without masks; only the
rest (the diagonal, a ragged tail, a window's lower edge) pays for them. Key blocks
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
from syncless.kernels.attention_config import QKConfig, config_for, fp32_precision
from syncless.kernels.rope import cos_strides, rounded
from syncless.kernels.selection import interpreting

_LOG2E = math.log2(math.e)
_LN2: tl.constexpr = tl.constexpr(math.log(2.0))
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _load_q(
    q_base, cos_base, sin_base, qpos, row_ok, d, d_ok, sqm, sqd, scl, scd,
    HEAD_DIM: tl.constexpr, ROPE: tl.constexpr, COMPUTE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """The block's query rows in ``COMPUTE`` (float32 holding them with ``UPCAST``),
    rotated first when ``ROPE``."""
    mask = row_ok[:, None] & d_ok[None, :]
    rows = qpos[:, None].to(tl.int64)
    q = tl.load(q_base + rows * sqm + d[None, :] * sqd, mask=mask, other=0.0)
    if ROPE:
        # rotate_half(x) = cat(-x[D/2:], x[:D/2]); x * cos + rotate_half(x) * sin.
        half: tl.constexpr = HEAD_DIM // 2
        first = d < half
        partner = tl.where(first, d + half, d - half)
        sign = tl.where(first, -1.0, 1.0)
        qp = tl.load(q_base + rows * sqm + partner[None, :] * sqd, mask=mask, other=0.0)
        cos = tl.load(cos_base + rows * scl + d[None, :] * scd, mask=mask, other=0.0)
        sin = tl.load(sin_base + rows * scl + d[None, :] * scd, mask=mask, other=0.0)
        q = q.to(tl.float32) * cos.to(tl.float32) + (qp.to(tl.float32) * sign[None, :]) * sin.to(
            tl.float32
        )
    return rounded(q, COMPUTE, UPCAST)


@triton.jit
def _k_logits(
    q, k_base, start, K_LEN, skn, skd, d, d_ok,
    PRECISION: tl.constexpr, COMPUTE: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_N: tl.constexpr, TAIL: tl.constexpr,
):  # fmt: skip
    """Unscaled logits ``[BLOCK_M, BLOCK_N]`` (float32) of the keys from ``start``;
    ``TAIL``: some may lie at or past ``K_LEN`` (loaded as zeros)."""
    n = start + tl.arange(0, BLOCK_N)
    mask = d_ok[None, :]
    if TAIL:
        mask = mask & (n < K_LEN)[:, None]
    kb = tl.load(k_base + n[:, None].to(tl.int64) * skn + d[None, :] * skd, mask=mask, other=0.0)
    kb = rounded(kb, COMPUTE, UPCAST)
    return tl.dot(q, tl.trans(kb), input_precision=PRECISION)


@triton.jit
def _masked_update(
    q, k_base, start, m, s_sum, t_sum, row_ok, kpos, K_LEN, WINDOW, skn, skd, d, d_ok, scale2,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    COMPUTE: tl.constexpr, UPCAST: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The running (m, S, T) after the key block at ``start``, some of whose pairs are
    not allowed (causal diagonal, sliding window edge, past ``K_LEN``, rows past the
    end)."""
    n = start + tl.arange(0, BLOCK_N)
    raw = _k_logits(q, k_base, start, K_LEN, skn, skd, d, d_ok,
                    PRECISION, COMPUTE, UPCAST, BLOCK_N, True)  # fmt: skip
    allowed = row_ok[:, None] & (n < K_LEN)[None, :]
    if CAUSAL:
        allowed = allowed & (n[None, :] <= kpos[:, None])
    if HAS_WINDOW:
        allowed = allowed & (kpos[:, None] - n[None, :] < WINDOW)
    raw = tl.where(allowed, raw, float("-inf"))
    m_new = tl.maximum(m, tl.max(raw, axis=1) * scale2)
    # A row that has seen no allowed key yet keeps m = -inf: shift by 0 instead, so no
    # -inf - -inf = nan appears; its S and T stay 0.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_ref)
    shift = tl.where(s_sum > 0, (m - m_ref) * s_sum, 0.0)
    centred = raw * scale2 - m_ref[:, None]
    p = tl.exp2(centred)
    t_sum = alpha * (t_sum + shift) + tl.sum(tl.where(allowed, p * centred, 0.0), axis=1)
    s_sum = alpha * s_sum + tl.sum(p, axis=1)
    return m_new, s_sum, t_sum


@triton.jit
def _qk_block(
    q_ptr, k_ptr, cos_ptr, sin_ptr, out_row, rb, b, h,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, scb, scl, scd,
    H, GROUP, N_ROWS, Q_LEN, K_LEN, WINDOW,
    scale2, weight, phase, stride,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, ROPE: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr,
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
    cos_base = cos_ptr + b.to(tl.int64) * scb
    sin_base = sin_ptr + b.to(tl.int64) * scb
    # Rows past N_ROWS load zeros: finite logits in the unmasked blocks, dropped at the end.
    q = _load_q(q_base, cos_base, sin_base, qpos, row_ok, d, d_ok, sqm, sqd, scl, scd,
                HEAD_DIM, ROPE, COMPUTE, UPCAST)  # fmt: skip
    # Bottom-right alignment: query i sits at key position i + K_LEN - Q_LEN.
    kpos = qpos + (K_LEN - Q_LEN)
    first_row = rb * BLOCK_M
    last_row = tl.minimum(first_row + BLOCK_M, N_ROWS) - 1
    # Keys [lo, a) and [b, hi) are allowed for some rows of the block (masked), [a, b)
    # for every row (no masks): the diagonal, a ragged tail and a sliding window's
    # lower edge are the only masked blocks.
    hi = K_LEN
    b_end = K_LEN
    if CAUSAL:
        hi = tl.minimum(K_LEN, phase + stride * last_row + (K_LEN - Q_LEN) + 1)
        # Up to the first row's own position; at least 0 (more queries than keys), so
        # no block starts at a negative key.
        b_end = tl.maximum(0, tl.minimum(K_LEN, phase + stride * first_row + (K_LEN - Q_LEN) + 1))
    b_end = (b_end // BLOCK_N) * BLOCK_N
    lo = 0
    a_start = 0
    if HAS_WINDOW:
        lo = tl.maximum(0, phase + stride * first_row + (K_LEN - Q_LEN) - WINDOW + 1)
        lo = (lo // BLOCK_N) * BLOCK_N
        # The last row's window starts here: keys from it on are inside every row's.
        a_start = phase + stride * last_row + (K_LEN - Q_LEN) - WINDOW + 1
        a_start = tl.maximum(lo, tl.cdiv(a_start, BLOCK_N) * BLOCK_N)
        # A window narrower than about BLOCK_M + BLOCK_N keys leaves no whole block
        # inside every row's: all of [lo, hi) is masked.
        some_inside = a_start < b_end
        a_start = tl.where(some_inside, a_start, lo)
        b_end = tl.where(some_inside, b_end, lo)

    # m is in scaled base-2 units; the scale rides in one multiply-add per logit
    # (raw * scale2 - m), and scale2 > 0 lets the row max be taken before scaling.
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    s_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    t_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    k_base = k_ptr + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
    for start in range(lo, a_start, BLOCK_N):
        m, s_sum, t_sum = _masked_update(
            q, k_base, start, m, s_sum, t_sum, row_ok, kpos, K_LEN, WINDOW, skn, skd, d, d_ok,
            scale2, CAUSAL, HAS_WINDOW, PRECISION, COMPUTE, UPCAST, BLOCK_N,
        )  # fmt: skip
    for start in tl.range(a_start, b_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        raw = _k_logits(q, k_base, start, K_LEN, skn, skd, d, d_ok,
                        PRECISION, COMPUTE, UPCAST, BLOCK_N, False)  # fmt: skip
        # Every logit is finite, so is m_new; only the first block's m = -inf with
        # S = 0 needs the (per-row, cheap) guard against -inf * 0.
        m_new = tl.maximum(m, tl.max(raw, axis=1) * scale2)
        alpha = tl.exp2(m - m_new)
        shift = tl.where(s_sum > 0, (m - m_new) * s_sum, 0.0)
        centred = raw * scale2 - m_new[:, None]
        p = tl.exp2(centred)
        t_sum = alpha * (t_sum + shift) + tl.sum(p * centred, axis=1)
        s_sum = alpha * s_sum + tl.sum(p, axis=1)
        m = m_new
    for start in range(b_end, hi, BLOCK_N):
        m, s_sum, t_sum = _masked_update(
            q, k_base, start, m, s_sum, t_sum, row_ok, kpos, K_LEN, WINDOW, skn, skd, d, d_ok,
            scale2, CAUSAL, HAS_WINDOW, PRECISION, COMPUTE, UPCAST, BLOCK_N,
        )  # fmt: skip

    entropy = tl.where(row_ok, tl.log(s_sum) - _LN2 * t_sum / s_sum, 0.0)
    tl.store(out_row + h, tl.max(tl.where(row_ok, m, float("-inf")), axis=0) * _LN2)
    tl.store(out_row + H + h, tl.sum(entropy, axis=0) * weight)
    tl.store(out_row + 2 * H, tl.sum(row_ok.to(tl.float32), axis=0), mask=h == 0)


# Batch-dependent sizes and the rotating phase are not specialised: Triton would
# compile a new variant (~100 ms, seen on the H200) for phase == 1 or a size that is a
# multiple of 16 the first time one appears, in the middle of training.
@triton.jit(do_not_specialize=["N_ROWS", "Q_LEN", "K_LEN", "N_RB", "WINDOW", "phase", "stride"])
def _qk_stats_kernel(
    gate_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, out_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, scb, scl, scd,
    H, GROUP, N_ROWS, Q_LEN, K_LEN, N_RB, WINDOW,
    scale2, weight, phase, stride,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, ROPE: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    # Off in this replay of a CUDA graph: return before reading (the fold of the same
    # gate drops the partials). Nested: GATED is a constexpr, the load exists only if on.
    if GATED:  # noqa: SIM102
        if tl.load(gate_ptr) == 0.0:
            return
    # Last row blocks first: under a causal mask they see the most keys, and starting
    # them first leaves the short ones to fill the tail of the launch.
    rb = N_RB - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    out_row = out_ptr + (b * N_RB + rb).to(tl.int64) * (2 * H + 1)
    _qk_block(
        q_ptr, k_ptr, cos_ptr, sin_ptr, out_row, rb, b, h,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, scb, scl, scd,
        H, GROUP, N_ROWS, Q_LEN, K_LEN, WINDOW, scale2, weight, phase, stride,
        HEAD_DIM, CAUSAL, HAS_WINDOW, ROPE, COMPUTE, PRECISION, UPCAST,
        BLOCK_M, BLOCK_N, BLOCK_D, WARP_SPECIALIZE,
    )  # fmt: skip


@triton.jit(do_not_specialize=["N_ROWS", "Q_LEN", "K_LEN", "N_RB", "WINDOW"])
def _qk_stats_grouped_kernel(
    gate_ptr, q_ptr, k_ptr, cos_ptr, sin_ptr, offsets_ptr, out_ptr,
    sqb, sqh, sqm, sqd, skb, skh, skn, skd, scb, scl, scd,
    H, GROUP, N_ROWS, Q_LEN, K_LEN, N_RB, WINDOW, L, OUT_STRIDE,
    scale2,
    HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, ROPE: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    Q_ALIGN: tl.constexpr, K_ALIGN: tl.constexpr, C_ALIGN: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """Every row (exact mode) of layer ``program_id(2)``: its q at ``offsets[layer]`` and
    its k at ``offsets[L + layer]`` elements from ``q_ptr`` / ``k_ptr`` (and, with
    ``ROPE``, its cos and sin at ``offsets[2L + layer]`` / ``offsets[3L + layer]``); its
    ``2H + 1`` columns at ``layer * (2H + 1)`` of ``out`` ``[B * N_RB, L * (2H + 1)]``."""
    # Off in this replay of a CUDA graph: return before reading (the fold of the same
    # gate drops the partials). Nested: GATED is a constexpr, the load exists only if on.
    if GATED:  # noqa: SIM102
        if tl.load(gate_ptr) == 0.0:
            return
    rb = N_RB - 1 - tl.program_id(0)  # the longest first (see _qk_stats_kernel)
    bh = tl.program_id(1)
    layer = tl.program_id(2)
    b = bh // H
    h = bh % H
    # Offsets read from memory carry no alignment the compiler can see: without
    # multiple_of every load is scalar, and the grouped launch ran 2.1x slower than one
    # launch per layer (5.59 against 2.64 ms for 16 layers of B 4, H 32/8, L 2048, D 64;
    # bench/monitors/attention_insitu.py at de5792c). LayerBatch only groups 16-byte aligned
    # tensors.
    q_base = q_ptr + tl.multiple_of(tl.load(offsets_ptr + layer), Q_ALIGN)
    k_base = k_ptr + tl.multiple_of(tl.load(offsets_ptr + L + layer), K_ALIGN)
    cos_base = cos_ptr
    sin_base = sin_ptr
    if ROPE:
        cos_base = cos_ptr + tl.multiple_of(tl.load(offsets_ptr + 2 * L + layer), C_ALIGN)
        sin_base = sin_ptr + tl.multiple_of(tl.load(offsets_ptr + 3 * L + layer), C_ALIGN)
    out_row = out_ptr + (b * N_RB + rb).to(tl.int64) * OUT_STRIDE + layer.to(tl.int64) * (2 * H + 1)
    _qk_block(
        q_base, k_base, cos_base, sin_base, out_row, rb, b, h,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, scb, scl, scd,
        H, GROUP, N_ROWS, Q_LEN, K_LEN, WINDOW, scale2, 1.0, 0, 1,
        HEAD_DIM, CAUSAL, HAS_WINDOW, ROPE, COMPUTE, PRECISION, UPCAST,
        BLOCK_M, BLOCK_N, BLOCK_D, WARP_SPECIALIZE,
    )  # fmt: skip


def _launch_args(
    q: torch.Tensor,
    q_rope: tuple[torch.Tensor, torch.Tensor] | None,
    compute_dtype: torch.dtype | None,
    config: QKConfig | None,
) -> tuple[tuple, dict]:
    """Pointers and strides of cos/sin, and the constexprs every launch shares."""
    compute = compute_dtype or q.dtype
    # The CPU interpreter (CI) computes the dot in numpy and multiplies bfloat16 bit
    # patterns as integers: round to the compute dtype, then upcast there.
    interp = interpreting()
    upcast = interp and compute == torch.bfloat16
    if interp:
        precision = "ieee"
    elif compute == torch.float32:
        precision = fp32_precision()
    else:
        precision = "tf32"  # not read for bf16/fp16 operands
    if q_rope is None:
        rope_args: tuple = (q, q, 0, 0, 0)  # never read (ROPE is off)
    else:
        cos, sin = q_rope
        rope_args = (cos, sin, *cos_strides(cos))
    cfg = config or config_for(q.shape[3])
    constexprs = {
        "HEAD_DIM": q.shape[3],
        "ROPE": q_rope is not None,
        "COMPUTE": _TL_DTYPES[compute],
        "PRECISION": precision,
        "UPCAST": upcast,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_D": max(16, triton.next_power_of_2(q.shape[3])),
        "WARP_SPECIALIZE": cfg.warp_specialize,
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
    }
    return rope_args, constexprs


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
    *,
    q_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    compute_dtype: torch.dtype | None = None,
    config: QKConfig | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Partials ``[B * ceil(n / BLOCK_M), 2H + 1]`` for query rows ``phase::stride``.

    ``q`` ``[B, H, Lq, D]`` (any strides), ``k`` ``[B, Hkv, Lk, D]``, ``H % Hkv == 0``.
    ``q_rope``: ``(cos, sin)`` ``[B or 1, Lq, D]``: ``q`` is not rotated yet (module doc).
    ``compute_dtype``: what q and k are rounded to before the dot (default ``q.dtype``).
    ``gate``: a float64 device flag; at 0 every program returns at once and the
    partials are left unwritten (the fold of the same gate skips them).
    """
    b, h, q_len, _ = q.shape
    hkv, k_len = k.shape[1], k.shape[2]
    n_rows = (q_len - phase + stride - 1) // stride
    rope_args, meta = _launch_args(q, q_rope, compute_dtype, config)
    n_rb = triton.cdiv(n_rows, meta["BLOCK_M"])
    out = torch.empty((b * n_rb, 2 * h + 1), dtype=torch.float32, device=q.device)
    cos, sin, scb, scl, scd = rope_args
    _qk_stats_kernel[(n_rb, b * h)](
        out if gate is None else gate, q, k, cos, sin, out, *q.stride(), *k.stride(),
        scb, scl, scd, h, h // hkv, n_rows, q_len, k_len, n_rb, window or 0,
        float(scale) * _LOG2E, float(weight), phase, stride,
        CAUSAL=causal, HAS_WINDOW=window is not None, GATED=gate is not None, **meta,
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
    *,
    q_rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    compute_dtype: torch.dtype | None = None,
    config: QKConfig | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Partials ``[B * ceil(Lq / BLOCK_M), L * (2H + 1)]`` of ``L`` layers, every query
    row (exact mode), in one launch: ``q``/``k`` (and ``q_rope``'s cos/sin) are layer
    0's, layer ``l``'s sit at ``offsets[l]`` / ``offsets[L + l]`` (cos and sin at
    ``offsets[2L + l]`` / ``offsets[3L + l]``) elements from them with the same shapes,
    dtypes and strides; every offset a multiple of 16 bytes (``LayerBatch`` checks).
    ``gate``: as in :func:`qk_stats_partials`."""
    b, h, q_len, _ = q.shape
    hkv, k_len = k.shape[1], k.shape[2]
    rope_args, meta = _launch_args(q, q_rope, compute_dtype, config)
    n_rb = triton.cdiv(q_len, meta["BLOCK_M"])
    width = 2 * h + 1
    out = torch.empty((b * n_rb, n_layers * width), dtype=torch.float32, device=q.device)
    cos, sin, scb, scl, scd = rope_args
    _qk_stats_grouped_kernel[(n_rb, b * h, n_layers)](
        out if gate is None else gate, q, k, cos, sin, offsets, out, *q.stride(), *k.stride(),
        scb, scl, scd, h, h // hkv, q_len, q_len, k_len, n_rb, window or 0, n_layers,
        n_layers * width, float(scale) * _LOG2E,
        CAUSAL=causal, HAS_WINDOW=window is not None, GATED=gate is not None, **meta,
        Q_ALIGN=16 // q.element_size(), K_ALIGN=16 // k.element_size(),
        C_ALIGN=16 // cos.element_size(),
    )  # fmt: skip
    return out
