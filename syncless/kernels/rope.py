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
from syncless.kernels.selection import interpreting

# Positions per program; every program walks all heads. A probe of 8 to 64 rows and 2
# to 8 warps on bench/monitors/attention_kernel.py's four head_dim shapes (H200, d57017b) found
# 16 rows with 4 warps within 10% of the best on each; 64 rows with 2 warps ran 5x
# slower (spills), so the tile stays small.
_BLOCK_L = 16
_WARPS = 4


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
    gate_ptr, x_ptr, cos_ptr, sin_ptr, out_ptr,
    sxb, sxh, sxl, sxd, scb, scl, scd, H, LEN,
    HEAD_DIM: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_HALF: tl.constexpr,
    EMULATE_BF16: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """``BLOCK_L`` positions of sequence ``program_id(1)``, every head: cos and sin are
    read once for all heads (one launch per head re-read them ``H`` times, more bytes
    than k itself), and each half of a row once (``rotate_half`` pairs them)."""
    # Off in this replay of a CUDA graph: return before reading (the fold of the same
    # gate drops the partials). Nested: GATED is a constexpr, the load exists only if on.
    if GATED:  # noqa: SIM102
        if tl.load(gate_ptr) == 0.0:
            return
    b = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, BLOCK_HALF)
    mask = (rows < LEN)[:, None] & (d < half)[None, :]
    r64 = rows[:, None].to(tl.int64)
    c_at = b.to(tl.int64) * scb + r64 * scl + d[None, :] * scd
    cos1 = tl.load(cos_ptr + c_at, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + c_at + half * scd, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + c_at, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + c_at + half * scd, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    for h in range(H):
        x_base = x_ptr + b.to(tl.int64) * sxb + h * sxh + r64 * sxl
        x1 = tl.load(x_base + d[None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_base + (d[None, :] + half) * sxd, mask=mask, other=0.0).to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1).
        y1 = x1 * cos1 + (-x2) * sin1
        y2 = x2 * cos2 + x1 * sin2
        out_base = out_ptr + ((b * H + h).to(tl.int64) * LEN + r64) * HEAD_DIM
        tl.store(out_base + d[None, :], rounded(y1, dtype, EMULATE_BF16).to(dtype), mask=mask)
        tl.store(
            out_base + half + d[None, :], rounded(y2, dtype, EMULATE_BF16).to(dtype), mask=mask
        )


def cos_strides(cos: torch.Tensor) -> tuple[int, int, int]:
    """Batch, position and dim strides of cos/sin ``[B or 1, L, D]``: a batch of one
    broadcasts (stride 0)."""
    return (0 if cos.shape[0] == 1 else cos.stride(0)), cos.stride(1), cos.stride(2)


@hot_path
def rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_dtype: torch.dtype,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` ``[B, H, L, D]`` (any strides) rotated by ``cos``/``sin`` ``[B or 1, L, D]``,
    as a new contiguous ``[B, H, L, D]`` tensor of ``out_dtype``. ``gate``: a float64
    device flag; at 0 the kernel returns at once and ``out`` is left unwritten (the
    statistics kernel reading it is off with the same gate)."""
    b, h, length, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"rotate: rotate_half needs an even head_dim, got {head_dim}")
    out = torch.empty((b, h, length, head_dim), dtype=out_dtype, device=x.device)
    _rotate_kernel[(triton.cdiv(length, _BLOCK_L), b)](
        out if gate is None else gate, x, cos, sin, out, *x.stride(), *cos_strides(cos),
        h, length, GATED=gate is not None,
        HEAD_DIM=head_dim, BLOCK_L=_BLOCK_L,
        BLOCK_HALF=max(16, triton.next_power_of_2(head_dim // 2)),
        EMULATE_BF16=interpreting() and out_dtype == torch.bfloat16, num_warps=_WARPS,
        # No fused multiply-add: torch multiplies and adds with a rounding each, and an
        # FMA's one rounding turned some keys 1 bf16 ulp away from the model's own on the
        # H200 (head_dim 80, tests/kernels/test_qk_stats.py). The launch reads and writes
        # memory; the extra instructions cost nothing.
        enable_fp_fusion=False,
    )  # fmt: skip
    return out
