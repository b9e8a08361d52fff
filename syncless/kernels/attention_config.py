"""Tile sizes of the attention statistics kernel per head_dim, and the dot precision of
float32 inputs (``syncless.kernels.attention``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QKConfig:
    """Tile sizes and launch shape of the statistics kernel. ``warp_specialize``: Triton
    splits the unmasked key loop into producer and consumer warps, to overlap the QK
    GEMM with the exponentials (what FlashAttention-3 does by hand); a sweep candidate
    (bench/monitors/attention_kernel.py), off unless it wins there. With Triton 3.6 on the H200
    it did not (add772f): 64 x 64 tiles and 128 x 64 with 4 warps failed to compile
    (assertions in Triton's Hopper warp-specialisation passes), and 128 x 64 with 8
    warps ran slower than the default, 0.244 against 0.142 ms at head_dim 128 and 0.322
    against 0.262 ms at 256. Kept for the sweep to try again on later Triton."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    warp_specialize: bool = False


# Per head_dim (the largest that fits wins). Before this table: 128 x 32, 8 warps for
# every head_dim (2.45 ms -> 1.51 ms on the demo's large shape with base 2 and unmasked
# blocks, bench/RESULTS.md monitor_kernels fb3e2cf); the entries below are
# bench/monitors/attention_kernel.py's sweep on the H200 (bench/RESULTS.md, attention_kernel).
# 64 x 64 with 4 warps took 0.453 ms on B 2, H 32/8, L 4096, D 128 against 0.585 ms at
# the former 128 x 32 with 8 warps, and 0.167 against 0.219 ms at D 64 (40bb95a). The
# sweep over 17 tiles on four shapes (e23b6ee) kept 64 x 64, 4 warps, 3 stages for D 64
# and 128 (best on each shape) and moved D 256 to 2 stages: 0.267 against 0.291 ms at
# 128 x 64, 8 warps on B 2, H 8/4, L 4096.
CONFIGS: dict[int, QKConfig] = {
    64: QKConfig(64, 64, 4, 3),
    128: QKConfig(64, 64, 4, 3),
    256: QKConfig(64, 64, 4, 2),
}


def config_for(head_dim: int) -> QKConfig:
    for dim in sorted(CONFIGS):
        if head_dim <= dim:
            return CONFIGS[dim]
    return CONFIGS[max(CONFIGS)]


# torch.get_float32_matmul_precision() -> the dot of float32 inputs: TF32 where torch's
# own float32 matmuls may use it, else three TF32 passes (float32-accurate).
_FP32_DOT = {"highest": "tf32x3", "high": "tf32", "medium": "tf32"}


def fp32_precision() -> str:
    """The dot precision of float32 inputs: what torch's own float32 matmuls may use."""
    return _FP32_DOT.get(torch.get_float32_matmul_precision(), "tf32x3")
