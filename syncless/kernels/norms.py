"""Per-group sums of squares over many tensors in one launch (the norms monitor).

``torch._foreach_norm`` over every parameter is one call but many launches: it chunks
the tensors into launches of a bounded size, 29.8 device activities per layer per
active step of the norms monitor on the demo large model (bench/RESULTS.md,
``monitor_kernels``), each a launch of host time. Here a *block table* built once per
list of tensors (which tensor, which element range; ``CHUNK`` elements per program)
drives one launch that reads every tensor and adds each block's float32 sum of squares
into its group's float64 total with an atomic add. Tensors are found, as in the
monitors' grouped launches, at int64 element offsets from the first tensor, re-read
from the tensors' addresses on every call (gradients move between steps).

Two kernels share the table. Before the optimizer step, :func:`group_param_grad_sumsq`
reads each parameter and its gradient once: both sums of squares and, optionally, the
flat snapshot of the parameters. After it, :func:`group_diff_sumsq` reads the
parameters and the snapshot: the sum of squares of the update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from syncless.hot_path import hot_path

CHUNK = 65536  # elements per program: few atomics per group, enough programs per tensor
_BLOCK = 2048


@triton.jit
def _block(tensor_of_ptr, start_ptr, sizes_ptr, offsets_ptr, pid, i, BLOCK: tl.constexpr):
    """Element indices (into the tensor and from the first tensor) of this program's
    ``i``-th block, and which of them exist."""
    t = tl.load(tensor_of_ptr + pid)
    idx = tl.load(start_ptr + pid) + i + tl.arange(0, BLOCK)
    ok = idx < tl.load(sizes_ptr + t)
    return t, idx, ok, tl.load(offsets_ptr + t) + idx


@triton.jit
def _param_grad_kernel(
    gate_ptr, p_ptr, p_offsets_ptr, g_ptr, g_offsets_ptr, sizes_ptr, tensor_of_ptr, start_ptr,
    group_of_ptr, prefix_ptr, snap_ptr, out_ptr, n_groups,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, GRADS: tl.constexpr, SNAPSHOT: tl.constexpr,
    GATED: tl.constexpr,
):  # fmt: skip
    # Off in this replay of a CUDA graph: return before reading (the fold of the same
    # gate drops the partials). Nested: GATED is a constexpr, the load exists only if on.
    if GATED:  # noqa: SIM102
        if tl.load(gate_ptr) == 0.0:
            return
    pid = tl.program_id(0)
    acc_p = tl.zeros([BLOCK], dtype=tl.float32)
    acc_g = tl.zeros([BLOCK], dtype=tl.float32)
    t = tl.load(tensor_of_ptr + pid)
    for i in range(0, CHUNK, BLOCK):
        t, idx, ok, at = _block(tensor_of_ptr, start_ptr, sizes_ptr, p_offsets_ptr, pid, i, BLOCK)
        v = tl.load(p_ptr + at, mask=ok, other=0.0)
        if SNAPSHOT:
            tl.store(snap_ptr + tl.load(prefix_ptr + t) + idx, v, mask=ok)
        x = v.to(tl.float32)
        acc_p += x * x
        if GRADS:
            g_at = tl.load(g_offsets_ptr + t) + idx
            w = tl.load(g_ptr + g_at, mask=ok, other=0.0).to(tl.float32)
            acc_g += w * w
    group = tl.load(group_of_ptr + t)
    tl.atomic_add(out_ptr + group, tl.sum(acc_p, axis=0).to(tl.float64))
    if GRADS:
        tl.atomic_add(out_ptr + n_groups + group, tl.sum(acc_g, axis=0).to(tl.float64))


@triton.jit
def _diff_sumsq_kernel(
    gate_ptr, x_ptr, offsets_ptr, sizes_ptr, tensor_of_ptr, start_ptr, group_of_ptr,
    prefix_ptr, snap_ptr, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
    GATED: tl.constexpr,
):  # fmt: skip
    # Off in this replay of a CUDA graph: return before reading (the fold of the same
    # gate drops the partials). Nested: GATED is a constexpr, the load exists only if on.
    if GATED:  # noqa: SIM102
        if tl.load(gate_ptr) == 0.0:
            return
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    t = tl.load(tensor_of_ptr + pid)
    for i in range(0, CHUNK, BLOCK):
        t, idx, ok, at = _block(tensor_of_ptr, start_ptr, sizes_ptr, offsets_ptr, pid, i, BLOCK)
        v = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
        before = tl.load(snap_ptr + tl.load(prefix_ptr + t) + idx, mask=ok, other=0.0)
        d = v - before.to(tl.float32)
        acc += d * d
    tl.atomic_add(out_ptr + tl.load(group_of_ptr + t), tl.sum(acc, axis=0).to(tl.float64))


@dataclass
class BlockTable:
    """The static description of a list of tensors (sizes, groups, blocks), on the
    device; built once, on the cold path."""

    sizes: torch.Tensor  # int64 [T]
    group_of: torch.Tensor  # int64 [T]
    prefix: torch.Tensor  # int64 [T]: each tensor's start in a flat snapshot
    tensor_of: torch.Tensor  # int32 [B]
    start: torch.Tensor  # int64 [B]
    total: int
    n_groups: int

    @staticmethod
    def build(tensors: list[torch.Tensor], groups: list[int], n_groups: int) -> BlockTable:
        device = tensors[0].device
        sizes = [t.numel() for t in tensors]
        tensor_of, start, prefix, at = [], [], [], 0
        for i, n in enumerate(sizes):
            prefix.append(at)
            at += n
            for s in range(0, n, CHUNK):
                tensor_of.append(i)
                start.append(s)

        def up(values: list[int], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device)

        return BlockTable(
            up(sizes, torch.int64),
            up(groups, torch.int64),
            up(prefix, torch.int64),
            up(tensor_of, torch.int32),
            up(start, torch.int64),
            at,
            n_groups,
        )


def element_offsets(tensors: list[torch.Tensor], sizes: list[int]) -> list[int] | None:
    """Element offsets of ``tensors`` from the first, or ``None`` if one differs from
    what the block table was built for (its element count ``sizes``, the first's dtype),
    is not contiguous, or sits at a fraction of an element. Checked on every call: a
    parameter swapped for another tensor, or a gradient of another dtype than the first
    gradient, must not be read through a stale table."""
    first = tensors[0]
    base, size, dtype = first.data_ptr(), first.element_size(), first.dtype
    out = []
    for t, n in zip(tensors, sizes, strict=True):
        if t.numel() != n or t.dtype != dtype or not t.is_contiguous():
            return None
        delta = t.data_ptr() - base
        if delta % size:
            return None
        out.append(delta // size)
    return out


@hot_path
def group_param_grad_sumsq(
    first_param: torch.Tensor,
    param_offsets: torch.Tensor,
    table: BlockTable,
    first_grad: torch.Tensor | None = None,
    grad_offsets: torch.Tensor | None = None,
    snap: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[2, n_groups]`` float64: per group, the sum of squares of its parameters (row 0)
    and of their gradients (row 1), from one launch that reads each parameter and its
    gradient once.

    Args:
        first_param: the first tensor of the table; the others sit ``param_offsets``
            (int64, from :func:`element_offsets`) elements from it.
        param_offsets: the parameters' element offsets, on the device.
        table: the parameters' :class:`BlockTable`.
        first_grad: the first parameter's gradient, or ``None`` to skip the gradients
            (row 1 stays zero). Gradients may have another dtype than the parameters.
        grad_offsets: the gradients' element offsets from ``first_grad``.
        snap: ``table.total`` elements of the parameters' dtype; when given, the same
            pass copies the parameters into it, one after another.
        gate: a float64 device flag; at 0 the kernel returns at once (the sums stay
            zero, the snapshot unwritten).
    """
    grads = first_grad is not None and grad_offsets is not None
    # A pointer the kernel skips (its flag off) still needs a tensor: the parameters'.
    if first_grad is None or grad_offsets is None:
        first_grad, grad_offsets = first_param, param_offsets
    out = torch.zeros(2 * table.n_groups, dtype=torch.float64, device=first_param.device)
    _param_grad_kernel[(table.tensor_of.numel(),)](
        out if gate is None else gate, first_param, param_offsets, first_grad, grad_offsets, table.sizes, table.tensor_of,
        table.start, table.group_of, table.prefix, first_param if snap is None else snap,
        out, table.n_groups, CHUNK=CHUNK, BLOCK=_BLOCK, GRADS=grads, SNAPSHOT=snap is not None,
        GATED=gate is not None,
    )  # fmt: skip
    return out.view(2, table.n_groups)


@hot_path
def group_diff_sumsq(
    first: torch.Tensor,
    offsets: torch.Tensor,
    table: BlockTable,
    snap: torch.Tensor,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[n_groups]`` float64: per group, the sum of squares of (tensor - snapshot)
    (``gate``: as in :func:`group_param_grad_sumsq`)."""
    out = torch.zeros(table.n_groups, dtype=torch.float64, device=first.device)
    _diff_sumsq_kernel[(table.tensor_of.numel(),)](
        out if gate is None else gate, first, offsets, table.sizes, table.tensor_of,
        table.start, table.group_of, table.prefix, snap, out, CHUNK=CHUNK, BLOCK=_BLOCK,
        GATED=gate is not None,
    )  # fmt: skip
    return out
