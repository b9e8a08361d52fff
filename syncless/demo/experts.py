"""The routed experts of an MoE layer, and three ways to run them.

Every way takes token rows already grouped by expert (``counts[e]`` rows for local
expert ``e``, counts on the device) and returns one output row per input row:

* ``grouped``: ``torch._grouped_mm`` over a buffer whose expert groups start at
  multiples of ``GROUP_ALIGN`` rows. Its size is a bound from the shapes, so no count
  is read back. The fast path on sm90/sm100 GPUs in bf16.
* ``padded``: ``torch.bmm`` over ``[experts, capacity, d]``. The capacity is fixed by
  the shapes: exact by default (every row fits), or ``capacity_factor`` times the
  mean load, when rows past it are dropped and counted. Sync-free on any device.
* ``loop``: one matmul per expert, split by counts read back to the host (a drain per
  layer): the standard code of most MoE trainers, kept to measure against.

``auto`` picks ``grouped`` where ``torch._grouped_mm`` runs without a host sync (CPU;
CUDA sm90/sm100 in bf16) and ``padded`` elsewhere, and in an fp32 graph torch.compile
traces (docs/demo.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from syncless.demo.config import EXPERT_IMPLS
from syncless.guard import allow_sync

# Rows per group boundary in the grouped buffer. The weight gradient is a grouped GEMM
# along the token dimension, and its groups must start at 16-byte multiples: 8 rows of
# bf16 (torch's GroupMMCommon.cuh asserts it on the device).
GROUP_ALIGN = 8


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls run in here: autocast's where it is on, else ``x``'s."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def grouped_mm_supported(
    device: torch.device, dtype: torch.dtype, dims: tuple[int, ...] = ()
) -> bool:
    """Whether ``torch._grouped_mm`` runs here without reading its offsets to the host.

    On CUDA its fast path needs compute capability 9.x or 10.x, bf16, and matrix
    dimensions (``dims``: d_model, hidden) that are 16-byte multiples; elsewhere it
    falls back to a loop over ``offs.cpu()``, a sync per call. The CPU kernel is that
    same loop, with no device to wait for.
    """
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        return True
    if device.type != "cuda" or dtype != torch.bfloat16 or any(n % 8 for n in dims):
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def resolve_impl(
    name: str, device: torch.device, dtype: torch.dtype, dims: tuple[int, ...] = ()
) -> str:
    """``auto`` -> ``grouped`` or ``padded`` for this device, compute dtype and the
    experts' ``dims`` (d_model, hidden)."""
    if name not in EXPERT_IMPLS:
        raise ValueError(f"unknown expert impl {name!r}; expected one of {EXPERT_IMPLS}")
    if name != "auto":
        return name
    return "grouped" if grouped_mm_supported(device, dtype, dims) else "padded"


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _place(counts: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, rank within the expert) of each of ``rows`` rows grouped by expert."""
    ends = counts.cumsum(0)
    row = torch.arange(rows, device=counts.device)
    # searchsorted, not repeat_interleave(counts): the latter's size is data-dependent.
    expert = torch.searchsorted(ends, row, right=True)
    return expert, row - (ends - counts)[expert]


def _sources(dest: torch.Tensor, slots: int, rows: int) -> torch.Tensor:
    """For each of ``slots`` buffer rows, the input row it copies.

    Row ``i`` goes to slot ``dest[i]``. A slot no row goes to (padding) copies some
    row too: its output is never read and its gradient is zero, so any finite value
    serves, and spreading them over the rows keeps the backward's atomic adds apart.
    """
    src = torch.arange(slots, device=dest.device) % max(rows, 1)
    return src.index_copy_(0, dest, torch.arange(rows, device=dest.device))


class Experts(nn.Module):
    """The SwiGLU MLPs of the experts this rank owns, stacked along dim 0.

    ``first_expert`` is the global index of local expert 0 (non-zero under expert
    parallelism), used only to seed each expert's initialisation. ``impl`` and
    ``capacity_factor``: see the module docstring.

    Example::

        experts = Experts(n_local=4, d_model=64, hidden=128)
        y = experts(rows, counts)  # rows [N, 64] grouped by expert, counts [4] on the device
    """

    def __init__(
        self,
        n_local: int,
        d_model: int,
        hidden: int,
        first_expert: int = 0,
        impl: str = "auto",
        capacity_factor: float = 0.0,
    ) -> None:
        super().__init__()
        if impl not in EXPERT_IMPLS:
            raise ValueError(f"unknown expert impl {impl!r}; expected one of {EXPERT_IMPLS}")
        self.first_expert = first_expert
        self.impl = impl
        self.capacity_factor = capacity_factor
        self.w_gate = nn.Parameter(torch.empty(n_local, d_model, hidden))
        self.w_up = nn.Parameter(torch.empty(n_local, d_model, hidden))
        self.w_down = nn.Parameter(torch.empty(n_local, hidden, d_model))
        # Rows the padded impl dropped over capacity since the trainer last read it
        # (device, int64); None until a forward that can drop runs.
        self.dropped_rows: torch.Tensor | None = None
        self._resolved: dict[tuple[torch.device, torch.dtype], str] = {}

    @property
    def n_local(self) -> int:
        return self.w_gate.shape[0]

    def forward(
        self,
        x: torch.Tensor,
        counts: torch.Tensor,
        *,
        index: torch.Tensor | None = None,
        host_counts: list[int] | None = None,
        max_rows: int | None = None,
    ) -> torch.Tensor:
        """Rows grouped by local expert -> their expert outputs, in the same order.

        Args:
            x: ``[N, d]`` rows, or ``[*, d]`` rows picked by ``index``.
            counts: ``[n_local]`` integer tensor: rows per expert, in order.
            index: row ``i`` is ``x[index[i]]`` (saves gathering the rows first).
            host_counts: ``counts`` already on the host (the loop needs no drain then).
            max_rows: a bound on any expert's count from the shapes (the padded
                impl's exact capacity); ``N`` when not given.
        """
        rows = x.shape[0] if index is None else index.shape[0]
        impl = self.resolved(x.device, compute_dtype(x))
        if impl == "loop":
            return self._loop(x if index is None else x.index_select(0, index), counts, host_counts)
        expert, rank = _place(counts, rows)
        if impl == "grouped":
            return self._grouped(x, index, counts, expert, rank, rows)
        return self._padded(x, index, expert, rank, rows, min(rows, max_rows or rows))

    def resolved(self, device: torch.device, dtype: torch.dtype) -> str:
        """The impl that runs for inputs on ``device`` computed in ``dtype``."""
        if self.impl == "auto" and dtype != torch.bfloat16 and torch.compiler.is_compiling():
            # torch._grouped_mm's fake kernel, which tracing runs, takes bf16 only (the
            # CPU's eager kernel takes fp32 too): a compiled fp32 graph runs padded.
            return "padded"
        key = (device, dtype)
        impl = self._resolved.get(key)
        if impl is None:
            dims = tuple(self.w_gate.shape[1:])
            impl = self._resolved[key] = resolve_impl(self.impl, device, dtype, dims)
        return impl

    @staticmethod
    def _gather(x: torch.Tensor, index: torch.Tensor | None, src: torch.Tensor, rows: int):
        if rows == 0:
            # Nothing routed here: zeros, which still give the weights a gradient, and
            # still built from x (+ its empty sum): under expert parallelism x came by an
            # all_to_all whose backward every rank must join, a rank with no rows too
            # (a graph cut here hung the other rank on NCCL).
            return x.new_zeros((src.shape[0], x.shape[1])) + x.sum()
        return x.index_select(0, src if index is None else index[src])

    def _grouped(self, x, index, counts, expert, rank, rows: int) -> torch.Tensor:
        dtype = compute_dtype(x)
        # Each expert's group rounded up to GROUP_ALIGN rows; the buffer's size is the
        # bound over all counts, and the last group runs to its end (rows past the last
        # offset would be left unwritten by the kernel).
        group = torch.div(counts + (GROUP_ALIGN - 1), GROUP_ALIGN, rounding_mode="floor")
        group = group * GROUP_ALIGN
        group_ends = group.cumsum(0)
        size = _round_up(rows + self.n_local * (GROUP_ALIGN - 1), GROUP_ALIGN)
        offsets = group_ends.to(torch.int32)
        # fill_ takes the scalar as a kernel argument; `offsets[-1] = size` copies it
        # from host memory, a sync the CUDA sync debug mode caught once per layer.
        offsets[-1:].fill_(size)
        dest = (group_ends - group)[expert] + rank
        buffer = self._gather(x, index, _sources(dest, size, rows), rows).to(dtype)
        w_gate, w_up, w_down = (w.to(dtype) for w in (self.w_gate, self.w_up, self.w_down))
        gate = torch._grouped_mm(buffer, w_gate, offs=offsets)
        up = torch._grouped_mm(buffer, w_up, offs=offsets)
        out = torch._grouped_mm(F.silu(gate) * up, w_down, offs=offsets)
        return out.index_select(0, dest)

    def _padded(self, x, index, expert, rank, rows: int, exact: int) -> torch.Tensor:
        n = self.n_local
        capacity = exact
        if self.capacity_factor > 0:
            mean = rows / max(n, 1)
            capacity = min(exact, _round_up(math.ceil(self.capacity_factor * mean), GROUP_ALIGN))
        capacity = max(capacity, 1)
        slot = expert * capacity + rank
        dropping = capacity < exact
        if dropping:
            keep = rank < capacity
            slot = torch.where(keep, slot, n * capacity)  # one spare slot takes the dropped
        src = _sources(slot, n * capacity + 1, rows)[: n * capacity]
        buffer = self._gather(x, index, src, rows).view(n, capacity, -1)
        h = F.silu(torch.bmm(buffer, self.w_gate)) * torch.bmm(buffer, self.w_up)
        out = torch.bmm(h, self.w_down).flatten(0, 1)
        if not dropping:
            return out.index_select(0, slot)
        y = out.index_select(0, slot.clamp(max=n * capacity - 1))
        dropped = (~keep).sum()
        self.dropped_rows = dropped if self.dropped_rows is None else self.dropped_rows + dropped
        return torch.where(keep.unsqueeze(1), y, 0.0)

    def _loop(self, x, counts, host_counts: list[int] | None) -> torch.Tensor:
        if host_counts is None:
            with allow_sync("--expert-impl loop: the per-layer count drain for split()"):
                host_counts = counts.tolist()
        # unbind, not w[e]: the backward of unbind is one stack of the expert gradients,
        # while each w[e] would materialise a zero-filled gradient of the whole [E, d, h]
        # parameter and add it up (3 x E full-size fills and adds per layer).
        gates, ups, downs = self.w_gate.unbind(0), self.w_up.unbind(0), self.w_down.unbind(0)
        outs = []
        for xe, w_gate, w_up, w_down in zip(x.split(host_counts), gates, ups, downs, strict=True):
            outs.append((F.silu(xe @ w_gate) * (xe @ w_up)) @ w_down)
        return torch.cat(outs)
