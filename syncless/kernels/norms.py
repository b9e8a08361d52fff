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

Three kernels share the table: the sum of squares of the tensors, a copy of them into
one flat snapshot, and the sum of squares of their difference from that snapshot
(the update of an optimizer step).
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
def _sumsq_kernel(
    x_ptr, offsets_ptr, sizes_ptr, tensor_of_ptr, start_ptr, group_of_ptr, out_ptr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    t = tl.load(tensor_of_ptr + pid)
    for i in range(0, CHUNK, BLOCK):
        t, _idx, ok, at = _block(tensor_of_ptr, start_ptr, sizes_ptr, offsets_ptr, pid, i, BLOCK)
        v = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
        acc += v * v
    tl.atomic_add(out_ptr + tl.load(group_of_ptr + t), tl.sum(acc, axis=0).to(tl.float64))


@triton.jit
def _copy_kernel(
    x_ptr, offsets_ptr, sizes_ptr, tensor_of_ptr, start_ptr, prefix_ptr, snap_ptr,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    for i in range(0, CHUNK, BLOCK):
        t, idx, ok, at = _block(tensor_of_ptr, start_ptr, sizes_ptr, offsets_ptr, pid, i, BLOCK)
        v = tl.load(x_ptr + at, mask=ok, other=0.0)
        tl.store(snap_ptr + tl.load(prefix_ptr + t) + idx, v, mask=ok)


@triton.jit
def _diff_sumsq_kernel(
    x_ptr, offsets_ptr, sizes_ptr, tensor_of_ptr, start_ptr, group_of_ptr, prefix_ptr,
    snap_ptr, out_ptr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
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
    parameter swapped for another tensor, or a gradient of another dtype, must not be
    read through a stale table."""
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
def group_sumsq(first: torch.Tensor, offsets: torch.Tensor, table: BlockTable) -> torch.Tensor:
    """``[n_groups]`` float64: per group, the sum of squares of its tensors."""
    out = torch.zeros(table.n_groups, dtype=torch.float64, device=first.device)
    _sumsq_kernel[(table.tensor_of.numel(),)](
        first, offsets, table.sizes, table.tensor_of, table.start, table.group_of, out,
        CHUNK=CHUNK, BLOCK=_BLOCK,
    )  # fmt: skip
    return out


@hot_path
def snapshot(first: torch.Tensor, offsets: torch.Tensor, table: BlockTable) -> torch.Tensor:
    """The tensors' values, flattened one after another into one new tensor."""
    snap = torch.empty(table.total, dtype=first.dtype, device=first.device)
    _copy_kernel[(table.tensor_of.numel(),)](
        first, offsets, table.sizes, table.tensor_of, table.start, table.prefix, snap,
        CHUNK=CHUNK, BLOCK=_BLOCK,
    )  # fmt: skip
    return snap


@hot_path
def group_diff_sumsq(
    first: torch.Tensor, offsets: torch.Tensor, table: BlockTable, snap: torch.Tensor
) -> torch.Tensor:
    """``[n_groups]`` float64: per group, the sum of squares of (tensor - snapshot)."""
    out = torch.zeros(table.n_groups, dtype=torch.float64, device=first.device)
    _diff_sumsq_kernel[(table.tensor_of.numel(),)](
        first, offsets, table.sizes, table.tensor_of, table.start, table.group_of,
        table.prefix, snap, out, CHUNK=CHUNK, BLOCK=_BLOCK,
    )  # fmt: skip
    return out
