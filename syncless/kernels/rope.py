"""Rotary position embedding of keys for the attention statistics kernel.

The Hugging Face adapter hands the attention monitor k *before* its rotation (the
model has no module boundary after it): re-applying the model's own
``apply_rotary_pos_emb`` in torch ops costs about six elementwise passes in float32 per
tensor, plus a cast, and holding float32 copies of every layer's q and k to the end of
the forward. Here one launch reads k once (in the model's dtype) with cos and sin and
writes the rotated keys once, already rounded to the dtype the statistics kernel
computes in. Queries are rotated inside that kernel instead (once per query block).

Rotate-half convention (Llama, Mistral, Qwen, Mixtral, ...): ``x * cos + rotate_half(x)
* sin`` with ``rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])``, computed in float32
as the model computes it when cos/sin are float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from syncless.hot_path import hot_path
from syncless.kernels import interpreting

_BLOCK_L = 64


@triton.jit
def rounded(x, DTYPE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """``x`` rounded to ``DTYPE``; ``EMULATE_BF16``: float32 holding the bf16 value,
    rounded to nearest even by hand (the CPU interpreter truncates ``.to(bfloat16)``
    and multiplies bf16 bit patterns as integers)."""
    if EMULATE_BF16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _rotate_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    sxb, sxh, sxl, sxd, scb, scl, scd, H, LEN,
    HEAD_DIM: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr,
    EMULATE_BF16: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    rows = pid * BLOCK_L + tl.arange(0, BLOCK_L)
    d = tl.arange(0, BLOCK_D)
    half: tl.constexpr = HEAD_DIM // 2
    first = d < half
    partner = tl.where(first, d + half, d - half)
    sign = tl.where(first, -1.0, 1.0)
    mask = (rows < LEN)[:, None] & (d < HEAD_DIM)[None, :]
    r64 = rows[:, None].to(tl.int64)
    x_base = x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + r64 * sxl
    x = tl.load(x_base + d[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_base + partner[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
    c_at = b.to(tl.int64) * scb + r64 * scl + d[None, :] * scd
    cos = tl.load(cos_ptr + c_at, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + c_at, mask=mask, other=0.0).to(tl.float32)
    y = x * cos + (xp * sign[None, :]) * sin
    out_base = out_ptr + (bh.to(tl.int64) * LEN + r64) * HEAD_DIM
    y = rounded(y, out_ptr.dtype.element_ty, EMULATE_BF16)
    tl.store(out_base + d[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def cos_strides(cos: torch.Tensor) -> tuple[int, int, int]:
    """Batch, position and dim strides of cos/sin ``[B or 1, L, D]``: a batch of one
    broadcasts (stride 0)."""
    return (0 if cos.shape[0] == 1 else cos.stride(0)), cos.stride(1), cos.stride(2)


@hot_path
def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``x`` ``[B, H, L, D]`` (any strides) rotated by ``cos``/``sin`` ``[B or 1, L, D]``,
    as a new contiguous ``[B, H, L, D]`` tensor of ``out_dtype``."""
    b, h, length, head_dim = x.shape
    out = torch.empty((b, h, length, head_dim), dtype=out_dtype, device=x.device)
    _rotate_kernel[(triton.cdiv(length, _BLOCK_L), b * h)](
        x, cos, sin, out, *x.stride(), *cos_strides(cos), h, length,
        HEAD_DIM=head_dim, BLOCK_L=_BLOCK_L, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        EMULATE_BF16=interpreting() and out_dtype == torch.bfloat16,
    )  # fmt: skip
    return out
