"""One read of a layer's output: per-channel max |x| with the sums of x^2 and x^4, or the
count of NaN/Inf elements.

``channel_absmax_partials``: programs tile ``[rows, channels]``; each reduces
``rows_per_program`` rows of ``BLOCK_C`` channels to their max |x|, so the partials are
``[P, C + 2]`` with ``P`` at most ``_MAX_PARTIALS`` (the fold then reads ``P * C`` floats,
under 1% of a ``[8192, 1024]`` bf16 activation). NaN is not propagated into the max
(the nonfinite monitor counts it). The last two columns are the sums of x^2 and x^4
over the program's rows and every channel, added atomically by its channel blocks:
the moments the activations monitor's RMS and kurtosis come from, in the same read.

``nonfinite_partials``: programs split the flattened tensor; each counts its elements
that are NaN or +-Inf. Partials ``[P, 1]``.

``output_stats_partials_grouped``: both, for every layer at once, in one read of each
layer output (the activations and nonfinite monitors read the same tensor).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from syncless.hot_path import hot_path

_BLOCK_R = 16
_BLOCK_C = 128
_MAX_PARTIALS = 128
_BLOCK = 1024
_MAX_PROGRAMS = 1024


@triton.jit
def _absmax_rows(
    x_ptr, pr, c, c_ok, R, sxr, ROWS_PER_PROGRAM,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Max |x| of channels ``c`` over this program's rows of ``x_ptr`` ``[R, C]``, and
    the sums of x^2 and x^4 over them (scalars)."""
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    sq = tl.zeros([BLOCK_C], dtype=tl.float32)
    quad = tl.zeros([BLOCK_C], dtype=tl.float32)
    r0 = pr * ROWS_PER_PROGRAM
    r_end = tl.minimum(r0 + ROWS_PER_PROGRAM, R)
    for i in range(r0, r_end, BLOCK_R):
        r = i + tl.arange(0, BLOCK_R)
        ok = (r < r_end)[:, None] & c_ok[None, :]
        v = tl.load(x_ptr + r[:, None].to(tl.int64) * sxr + c[None, :], mask=ok, other=0.0)
        v = v.to(tl.float32)
        acc = tl.maximum(acc, tl.max(tl.abs(v), axis=0))
        v2 = v * v
        sq += tl.sum(v2, axis=0)
        quad += tl.sum(v2 * v2, axis=0)
    return acc, tl.sum(sq, axis=0), tl.sum(quad, axis=0)


# Row counts vary with the batch: not specialised (no mid-run recompile).
@triton.jit(do_not_specialize=["R", "ROWS_PER_PROGRAM"])
def _absmax_kernel(
    gate_ptr, x_ptr, out_ptr, R, C, sxr, ROWS_PER_PROGRAM,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    # Off in this replay of a CUDA graph: return before reading (the fold of the same
    # gate drops the partials). Nested: GATED is a constexpr, the load exists only if on.
    if GATED:  # noqa: SIM102
        if tl.load(gate_ptr) == 0.0:
            return
    pr = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    acc, sq, quad = _absmax_rows(x_ptr, pr, c, c_ok, R, sxr, ROWS_PER_PROGRAM, BLOCK_R, BLOCK_C)
    row = out_ptr + pr.to(tl.int64) * (C + 2)
    tl.store(row + c, acc, mask=c_ok)
    tl.atomic_add(row + C, sq)
    tl.atomic_add(row + C + 1, quad)


@triton.jit(do_not_specialize=["R", "ROWS_PER_PROGRAM"])
def _absmax_grouped_kernel(
    gate_ptr, x_ptr, offsets_ptr, out_ptr, R, C, sxr, ROWS_PER_PROGRAM, OUT_STRIDE,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ALIGN: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """Layer ``program_id(2)`` reads ``x_ptr + offsets[layer]`` (elements) and writes its
    partials at columns ``[layer * (C + 2), (layer + 1) * (C + 2))`` of the zeroed ``out``
    ``[P, L * (C + 2)]``: its maxima, then its sums of x^2 and x^4."""
    # Off in this replay of a CUDA graph: return before reading (the fold of the same
    # gate drops the partials). Nested: GATED is a constexpr, the load exists only if on.
    if GATED:  # noqa: SIM102
        if tl.load(gate_ptr) == 0.0:
            return
    pr = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    layer = tl.program_id(2)
    c_ok = c < C
    base = x_ptr + tl.multiple_of(tl.load(offsets_ptr + layer), ALIGN)  # see attention
    acc, sq, quad = _absmax_rows(base, pr, c, c_ok, R, sxr, ROWS_PER_PROGRAM, BLOCK_R, BLOCK_C)
    row = out_ptr + pr.to(tl.int64) * OUT_STRIDE + layer.to(tl.int64) * (C + 2)
    tl.store(row + c, acc, mask=c_ok)
    tl.atomic_add(row + C, sq)
    tl.atomic_add(row + C + 1, quad)


@triton.jit(do_not_specialize=["R", "ROWS_PER_PROGRAM"])
def _output_grouped_kernel(
    gate_ptr, x_ptr, offsets_ptr, out_ptr, R, C, sxr, ROWS_PER_PROGRAM, OUT_STRIDE,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ALIGN: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """Both reads of a layer output in one pass: per-channel max |x| at columns
    ``[layer * (C + 3), layer * (C + 3) + C)``, then the sums of x^2 and x^4 and the
    NaN/Inf count, added atomically by every channel block of the row block, of the
    zeroed ``out`` ``[P, L * (C + 3)]``."""
    # Off in this replay of a CUDA graph: return before reading (the fold of the same
    # gate drops the partials). Nested: GATED is a constexpr, the load exists only if on.
    if GATED:  # noqa: SIM102
        if tl.load(gate_ptr) == 0.0:
            return
    pr = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    layer = tl.program_id(2)
    c_ok = c < C
    base = x_ptr + tl.multiple_of(tl.load(offsets_ptr + layer), ALIGN)  # see attention
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    sq = tl.zeros([BLOCK_C], dtype=tl.float32)
    quad = tl.zeros([BLOCK_C], dtype=tl.float32)
    bad = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.int32)
    r0 = pr * ROWS_PER_PROGRAM
    r_end = tl.minimum(r0 + ROWS_PER_PROGRAM, R)
    for i in range(r0, r_end, BLOCK_R):
        r = i + tl.arange(0, BLOCK_R)
        ok = (r < r_end)[:, None] & c_ok[None, :]
        v = tl.load(base + r[:, None].to(tl.int64) * sxr + c[None, :], mask=ok, other=0.0)
        v = v.to(tl.float32)
        acc = tl.maximum(acc, tl.max(tl.abs(v), axis=0))
        v2 = v * v
        sq += tl.sum(v2, axis=0)
        quad += tl.sum(v2 * v2, axis=0)
        bad += ((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32)
    row = out_ptr + pr.to(tl.int64) * OUT_STRIDE + layer.to(tl.int64) * (C + 3)
    tl.store(row + c, acc, mask=c_ok)
    tl.atomic_add(row + C, tl.sum(sq, axis=0))
    tl.atomic_add(row + C + 1, tl.sum(quad, axis=0))
    # Exact in float32: a row block's count is at most ROWS_PER_PROGRAM * C << 2**24.
    tl.atomic_add(row + C + 2, tl.sum(tl.sum(bad, axis=1), axis=0).to(tl.float32))


@triton.jit
def _nonfinite_count(x_ptr, program, n, PER_PROGRAM, BLOCK: tl.constexpr):
    """NaN/Inf elements among this program's ``PER_PROGRAM`` of the flat ``x_ptr``."""
    start = program.to(tl.int64) * PER_PROGRAM
    end = tl.minimum(start + PER_PROGRAM, n)
    bad = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(start, end, BLOCK):
        o = i + tl.arange(0, BLOCK)
        v = tl.load(x_ptr + o, mask=o < end, other=0.0).to(tl.float32)
        bad += ((v != v) | (tl.abs(v) == float("inf"))).to(tl.int32)
    return tl.sum(bad, axis=0).to(tl.float32)


@triton.jit(do_not_specialize=["n", "PER_PROGRAM"])
def _nonfinite_kernel(
    gate_ptr, x_ptr, out_ptr, n, PER_PROGRAM, BLOCK: tl.constexpr, GATED: tl.constexpr
):  # fmt: skip
    # Off in this replay of a CUDA graph: return before reading (the fold of the same
    # gate drops the partials). Nested: GATED is a constexpr, the load exists only if on.
    if GATED:  # noqa: SIM102
        if tl.load(gate_ptr) == 0.0:
            return
    program = tl.program_id(0)
    tl.store(out_ptr + program, _nonfinite_count(x_ptr, program, n, PER_PROGRAM, BLOCK))


@triton.jit(do_not_specialize=["n", "PER_PROGRAM"])
def _nonfinite_grouped_kernel(
    gate_ptr, x_ptr, offsets_ptr, out_ptr, n, PER_PROGRAM, L,
    BLOCK: tl.constexpr, ALIGN: tl.constexpr, GATED: tl.constexpr,
):  # fmt: skip
    """Layer ``program_id(1)`` reads ``x_ptr + offsets[layer]``; ``out`` is ``[P, L]``."""
    # Off in this replay of a CUDA graph: return before reading (the fold of the same
    # gate drops the partials). Nested: GATED is a constexpr, the load exists only if on.
    if GATED:  # noqa: SIM102
        if tl.load(gate_ptr) == 0.0:
            return
    program = tl.program_id(0)
    layer = tl.program_id(1)
    base = x_ptr + tl.multiple_of(tl.load(offsets_ptr + layer), ALIGN)  # see attention
    count = _nonfinite_count(base, program, n, PER_PROGRAM, BLOCK)
    tl.store(out_ptr + program.to(tl.int64) * L + layer, count)


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, channels]`` with unit channel stride (a copy only if it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _row_split(rows: int) -> tuple[int, int]:
    """(rows per program, programs along the rows): at most ``_MAX_PARTIALS`` partials."""
    per_program = max(_BLOCK_R, triton.cdiv(rows, _MAX_PARTIALS))
    per_program = triton.cdiv(per_program, _BLOCK_R) * _BLOCK_R
    return per_program, triton.cdiv(rows, per_program)


@hot_path
def channel_absmax_partials(x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Partials ``[P, C + 2]`` of per-channel max |x| over every dimension but the last,
    then the sums of x^2 and x^4. ``gate``: a float64 device flag; at 0 the kernel
    returns at once and leaves the partials unwritten (the fold of the same gate skips
    them)."""
    x2 = rows_view(x)
    rows, channels = x2.shape
    per_program, n_partials = _row_split(rows)
    out = torch.zeros((n_partials, channels + 2), dtype=torch.float32, device=x.device)
    grid = (n_partials, triton.cdiv(channels, _BLOCK_C))
    _absmax_kernel[grid](
        out if gate is None else gate, x2, out, rows, channels, x2.stride(0), per_program,
        BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C, GATED=gate is not None,
    )  # fmt: skip
    return out


def _flat_split(n: int) -> tuple[int, int]:
    """(elements per program, programs): at most ``_MAX_PROGRAMS`` partials."""
    per_program = triton.cdiv(max(triton.cdiv(n, _MAX_PROGRAMS), 1), _BLOCK) * _BLOCK
    return per_program, max(1, triton.cdiv(n, per_program))


def flat_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened, as the nonfinite kernels read it (a copy only if it must)."""
    return x.reshape(-1) if x.is_contiguous() else x.contiguous().view(-1)


@hot_path
def nonfinite_partials(x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Partials ``[P, 1]``: NaN/Inf elements of ``x`` per program (``gate``: as in
    :func:`channel_absmax_partials`)."""
    flat = flat_view(x)
    n = flat.numel()
    per_program, n_programs = _flat_split(n)
    out = torch.empty((n_programs, 1), dtype=torch.float32, device=x.device)
    _nonfinite_kernel[(n_programs,)](
        out if gate is None else gate, flat, out, n, per_program,
        BLOCK=_BLOCK, GATED=gate is not None,
    )  # fmt: skip
    return out


@hot_path
def channel_absmax_partials_grouped(
    first: torch.Tensor, offsets: torch.Tensor, n_layers: int, gate: torch.Tensor | None = None
) -> torch.Tensor:
    """Partials ``[P, L * (C + 2)]`` of ``L`` layers' ``[rows, channels]`` views in one
    launch: per layer its maxima, then its sums of x^2 and x^4.

    ``first`` is layer 0's view; layer ``l``'s view starts ``offsets[l]`` elements from
    it (an int64 device tensor) and has the same shape, dtype and row stride.
    """
    rows, channels = first.shape
    per_program, n_partials = _row_split(rows)
    width = n_layers * (channels + 2)
    out = torch.zeros((n_partials, width), dtype=torch.float32, device=first.device)
    grid = (n_partials, triton.cdiv(channels, _BLOCK_C), n_layers)
    _absmax_grouped_kernel[grid](
        out if gate is None else gate, first, offsets, out, rows, channels, first.stride(0),
        per_program, width,
        BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C, ALIGN=16 // first.element_size(),
        GATED=gate is not None,
    )  # fmt: skip
    return out


@hot_path
def nonfinite_partials_grouped(
    first: torch.Tensor, offsets: torch.Tensor, n_layers: int, gate: torch.Tensor | None = None
) -> torch.Tensor:
    """Partials ``[P, L]``: NaN/Inf counts of ``L`` layers' flat views in one launch
    (layer ``l`` at ``offsets[l]`` elements from ``first``, the same size and dtype)."""
    n = first.numel()
    per_program, n_programs = _flat_split(n)
    out = torch.empty((n_programs, n_layers), dtype=torch.float32, device=first.device)
    _nonfinite_grouped_kernel[(n_programs, n_layers)](
        out if gate is None else gate, first, offsets, out, n, per_program, n_layers,
        BLOCK=_BLOCK, ALIGN=16 // first.element_size(), GATED=gate is not None,
    )  # fmt: skip
    return out


@hot_path
def output_stats_partials_grouped(
    first: torch.Tensor, offsets: torch.Tensor, n_layers: int, gate: torch.Tensor | None = None
) -> torch.Tensor:
    """``channel_absmax_partials_grouped`` and ``nonfinite_partials_grouped`` in one read:
    partials ``[P, L * (C + 3)]``, per layer its ``C`` per-channel maxima, its sums of
    x^2 and x^4, then its NaN/Inf count (``first``, ``offsets`` as there: ``[rows,
    channels]`` views)."""
    rows, channels = first.shape
    per_program, n_partials = _row_split(rows)
    width = n_layers * (channels + 3)
    out = torch.zeros((n_partials, width), dtype=torch.float32, device=first.device)
    grid = (n_partials, triton.cdiv(channels, _BLOCK_C), n_layers)
    _output_grouped_kernel[grid](
        out if gate is None else gate, first, offsets, out, rows, channels, first.stride(0),
        per_program, width, BLOCK_R=_BLOCK_R, BLOCK_C=_BLOCK_C,
        ALIGN=16 // first.element_size(), GATED=gate is not None,
    )  # fmt: skip
    return out


def output_counts_exact(rows: int, channels: int) -> bool:
    """Whether ``output_stats_partials_grouped``'s float32 counts are exact for these
    views: a row block's count is at most its rows times the channels."""
    per_program, _ = _row_split(rows)
    return per_program * channels <= 2**24
