"""One read of the gradient arriving at a block's output: sum of squares, max |g| and
the NaN/Inf count, as partials ``[P, 3]`` that one fold turns into the layer's slots.

Programs split the flattened gradient; each writes its sum of g^2 (float32 over at most
``PER_PROGRAM`` elements, summed in float64 by the fold), its max |g| and its count of
NaN/Inf elements. The sum and the max are over the finite elements: the count says how
many were not, and the finite part stays readable at the step it went wrong (an H100 run
of the first version, which let Inf into the max, reported the max as Inf: no scale).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from syncless.hot_path import hot_path
from syncless.kernels.activations import flat_view

_BLOCK = 1024
_MAX_PROGRAMS = 1024


@triton.jit(do_not_specialize=["n", "PER_PROGRAM"])
def _grad_stats_kernel(
    gate_ptr, g_ptr, out_ptr, n, PER_PROGRAM, BLOCK: tl.constexpr, GATED: tl.constexpr
):  # fmt: skip
    # Off in this replay of a CUDA graph: return before reading (the fold of the same
    # gate drops the partials). Nested: GATED is a constexpr, the load exists only if on.
    if GATED:  # noqa: SIM102
        if tl.load(gate_ptr) == 0.0:
            return
    program = tl.program_id(0)
    start = program.to(tl.int64) * PER_PROGRAM
    end = tl.minimum(start + PER_PROGRAM, n)
    sq = tl.zeros([BLOCK], dtype=tl.float32)
    top = tl.zeros([BLOCK], dtype=tl.float32)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(start, end, BLOCK):
        o = i + tl.arange(0, BLOCK)
        v = tl.load(g_ptr + o, mask=o < end, other=0.0).to(tl.float32)
        a = tl.abs(v)
        finite = a < float("inf")  # False for NaN too
        a = tl.where(finite, a, 0.0)
        sq += a * a
        top = tl.maximum(top, a)
        bad += (~finite).to(tl.int32)
    row = out_ptr + program.to(tl.int64) * 3
    tl.store(row, tl.sum(sq, axis=0))
    tl.store(row + 1, tl.max(top, axis=0))
    tl.store(row + 2, tl.sum(bad, axis=0).to(tl.float32))


@hot_path
def grad_stats_partials(g: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Partials ``[P, 3]`` of ``g``: (sum of g^2, max |g|, NaN/Inf elements) per program.
    ``gate``: a float64 device flag; at 0 the kernel returns at once, the partials left
    unwritten (the fold of the same gate skips them)."""
    flat = flat_view(g)
    n = flat.numel()
    per_program = triton.cdiv(max(triton.cdiv(n, _MAX_PROGRAMS), 1), _BLOCK) * _BLOCK
    n_programs = max(1, triton.cdiv(n, per_program))
    out = torch.empty((n_programs, 3), dtype=torch.float32, device=g.device)
    _grad_stats_kernel[(n_programs,)](
        out if gate is None else gate, flat, out, n, per_program,
        BLOCK=_BLOCK, GATED=gate is not None,
    )  # fmt: skip
    return out
