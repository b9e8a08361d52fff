"""Per-row sums of the digest, computed on the device for dense and jagged fields.

Step 3 of the digest (:mod:`syncless.dataplane.digest_scheme`): the position-weighted,
transformed 8-byte chunks of each row, summed in wrapping int64;
:func:`~syncless.dataplane.integrity.row_digests` salts and finishes them.

How the sum is computed (no Python loop over rows, nothing read from the device on the
host; every path gives the digest of :mod:`syncless.dataplane.digest_scheme`, which the
tests check against a pure-Python version of it):

- Dense fields: blocks of rows (and of chunks, for rows longer than a block). A row
  whose byte length is a multiple of 8, starting on an 8-byte boundary, is read in place
  as int64; other rows are copied into a zero-padded block buffer. The weights of one
  row are broadcast. fp32 rows have two elements per chunk, bf16 four, 1-byte types eight.
- Jagged fields whose cached row lengths (host metadata, set when the nested tensor is
  built from a list: ``nested_tensor``/``as_nested_tensor``, what transfer clients
  return) are all equal and cover ``values`` exactly: the dense layout
  ``values.view(rows, -1)``. For a valid nested tensor those lengths leave
  ``offsets == arange(rows + 1) * length`` as the only possible offsets.
- Other jagged fields (varied lengths, no cached lengths, holes): a row's first byte
  need not sit on an 8-byte boundary of the value bytes, so rows are grouped by that
  offset modulo 8 (``8 / gcd(bytes per value, 8)`` groups: 2 for 1-D fp32 rows). Each
  group reads the value bytes from its offset on as chunks, in blocks: a chunk's index
  within its row is a cumulative sum (ones, minus each row's start increment at its
  start), its weight a gather from the table below, and a row's sum the difference of a
  cumulative sum of the transformed chunks at its bounds, so chunks in no row of the
  group drop out without a mask. A row's last chunk is read with the bytes that follow
  the row; a per-row correction swaps in the zero-padded one.

Weights of chunk positions ``0 .. n-1`` are computed once per device and cached (grown
geometrically to the longest row seen, 8 bytes per chunk, up to 2^24 positions = 128
MiB; beyond that they are computed per block): a pure function of the position, so the
cache changes no digest. On a CPU the block temporaries are per-thread buffers reused
across calls (about 10 MiB per thread).

Cost: dense and equal-length jagged fields take five int64 passes per chunk over blocks
that stay in cache (multiply, shift, mask, xor, sum), on 8 bytes of the field each:
1.5-1.8x ``torch.hash_tensor``'s XOR fold on fp32 rows. Other jagged fields read the
bytes once per group and add per chunk a cumulative sum for positions, a weight gather
and a cumulative sum for the rows: 5-8x the dense cost for 1-D fp32 rows. Measured
numbers: ``bench/dataplane/integrity.py`` and ``bench/RESULTS.md``. On an accelerator
the temporaries are a few int64 tensors of at most 2^26 chunks each.
"""

from __future__ import annotations

import math
import threading

import torch

from syncless.dataplane.digest_scheme import _transform, _transform_into, _weights
from syncless.hot_path import hot_path

# Chunks per block of the transform. On a CPU the int64 temporaries of a block (two of
# 2 MiB) stay in cache. Measured on 2 cores, ms per [1536, 4360] fp32 field, dense /
# varied-length jagged (hash_tensor: 2.0): 2^16: 4.4 / 23.4, 2^17: 3.8 / 19.7, 2^18:
# 3.0 / 18.0, 2^19: 2.8 / 18.6, 2^20: 3.1 / 23.5. On an accelerator typical fields are one
# block (fewer launches).
_BLOCK_CHUNKS_CPU = 1 << 18
_BLOCK_CHUNKS_DEVICE = 1 << 26
# Chunk weights come from the cached table as long as it needs at most this many positions
# (8 bytes each: 128 MiB); beyond it they are computed per block.
_TABLE_MAX_POSITIONS = 1 << 24

# Weights of chunk positions [0, n) per device, grown geometrically. They are a pure
# function of the position, so the cache changes no digest; it saves ~10 int64 ops per
# weight per call.
_WEIGHT_TABLES: dict[torch.device, torch.Tensor] = {}
# Per-thread CPU buffers for the temporaries, reused across calls: fresh pages cost page
# faults, measured 4.2 vs 2.8 ms per [1536, 4360] fp32 field (2 cores). About 10 MiB per
# thread that digests at most; accelerators allocate (their caching allocator reuses).
_SCRATCH = threading.local()


def _weight_table(device: torch.device, n: int) -> torch.Tensor:
    """``_weights(arange(n))`` from the per-device cache (grown to at least ``n``)."""
    table = _WEIGHT_TABLES.get(device)
    if table is None or table.shape[0] < n:
        size = max(n, 1 << 12, 0 if table is None else 2 * table.shape[0])
        table = _weights(torch.arange(size, device=device, dtype=torch.int64))
        _WEIGHT_TABLES[device] = table
    return table[:n]


def _scratch(name: str, device: torch.device, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    """An uninitialised tensor for temporaries (see ``_SCRATCH``); ``name`` keeps the
    buffers of one call apart."""
    if device.type != "cpu":
        return torch.empty(shape, device=device, dtype=dtype)
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    numel = math.prod(shape)
    buf = buffers.get((name, dtype))
    if buf is None or buf.numel() < numel:
        buf = buffers[(name, dtype)] = torch.empty(numel, dtype=dtype)
    return buf[:numel].view(shape)


@hot_path
def _byte_rows(x: torch.Tensor) -> torch.Tensor:
    """The bytes of each row of ``x`` (first dim) in row-major element order, as stored:
    uint8 ``[x.shape[0], bytes per row]`` (complex as its real/imag pairs)."""
    x = x.contiguous()
    if x.is_complex():
        x = torch.view_as_real(x)
    rows = x.flatten(1) if x.dim() > 1 else x.unsqueeze(1)
    return rows.view(torch.uint8)


def _aligned(x: torch.Tensor) -> bool:
    """Whether ``x``'s first byte sits on an 8-byte boundary (host metadata, no sync)."""
    return x.data_ptr() % 8 == 0


def _block_chunks(device: torch.device) -> int:
    return _BLOCK_CHUNKS_CPU if device.type == "cpu" else _BLOCK_CHUNKS_DEVICE


@hot_path
def _dense_chunks(
    byte_rows: torch.Tensor, rows: slice, first: int, n: int, pad: torch.Tensor | None
) -> torch.Tensor:
    """Chunks ``first .. first + n - 1`` of the rows ``rows`` of ``byte_rows`` as int64:
    a view (``pad`` None), else copied into ``pad`` past whose end the row is zero."""
    if pad is None:
        return byte_rows[rows, 8 * first : 8 * (first + n)].view(torch.int64)
    src = byte_rows[rows, 8 * first : 8 * (first + n)]
    block = pad[: src.shape[0], : 8 * n]
    block[:, : src.shape[1]].copy_(src)
    block[:, src.shape[1] :].zero_()
    return block.view(torch.int64)


@hot_path
def _chunk_weights(
    table: torch.Tensor | None, first: int, n: int, device: torch.device
) -> torch.Tensor:
    """Weights of chunk positions ``first .. first + n - 1``: a slice of ``table``, or
    computed when there is none."""
    if table is not None:
        return table[first : first + n]
    return _weights(torch.arange(first, first + n, device=device, dtype=torch.int64))


@hot_path
def _dense_sums(byte_rows: torch.Tensor) -> torch.Tensor:
    """Wrapping int64 sum of the transformed chunks of each row of ``byte_rows`` [rows,
    bytes]. Rows whose length is a multiple of 8 are read in place; others are copied into
    a zero-padded block buffer (padding chunks contribute nothing: ``0 * w = 0``). Blocks
    of rows, and of chunks for rows longer than a block (a loop fixed by the static shape,
    not by the data), bound the temporaries."""
    rows, nbytes = byte_rows.shape
    device = byte_rows.device
    n = -(-nbytes // 8)  # chunks per row
    sums = torch.zeros(rows, device=device, dtype=torch.int64)
    if n == 0:
        return sums
    table = _weight_table(device, n) if n <= _TABLE_MAX_POSITIONS else None
    width = min(n, _block_chunks(device))
    step = max(1, _block_chunks(device) // width)
    size = min(step, rows)
    in_place = nbytes % 8 == 0 and _aligned(byte_rows)
    pad = None if in_place else _scratch("pad", device, torch.uint8, size, 8 * width)
    t = _scratch("t", device, torch.int64, size, width)
    u = _scratch("u", device, torch.int64, size, width)
    for lo in range(0, rows, step):
        hi = min(lo + step, rows)
        for first in range(0, n, width):
            m = min(width, n - first)
            chunks = _dense_chunks(byte_rows, slice(lo, hi), first, m, pad)
            tb, ub = t[: hi - lo, :m], u[: hi - lo, :m]
            _transform_into(chunks, _chunk_weights(table, first, m, device), tb, ub)
            if m == n:
                torch.sum(tb, dim=1, out=sums[lo:hi])
            else:
                sums[lo:hi] += tb.sum(dim=1)
    return sums


@hot_path
def _position_weights(
    pos: torch.Tensor, table: torch.Tensor | None, clamp: bool, out: torch.Tensor
) -> torch.Tensor:
    """Weights of chunk positions ``pos`` into ``out``: gathered from ``table``
    (``clamp``: positions past it lie outside every row and are clamped into it), else
    computed."""
    if table is None:
        return out.copy_(_weights(pos))
    if clamp:
        pos = pos.clamp_(max=table.shape[0] - 1)
    return torch.index_select(table, 0, pos, out=out)


@hot_path
def _positions_in_rows(
    pos: torch.Tensor, marks: torch.Tensor, at: torch.Tensor, increments: torch.Tensor, lo: int
) -> torch.Tensor:
    """Into ``pos`` [n]: the index within its row of each chunk ``lo .. lo + n - 1``
    (chunks in no row get some index in ``[0, lo + n)``), a cumulative sum of ones minus
    each row's start increment at its start. ``at`` holds the row starts minus ``lo``
    clamped into ``[0, n]`` (rows starting before the block land on 0, after it on n);
    ``increments`` are the row starts minus the previous row's start, negated; ``marks``
    (int64, longer than ``n``) holds ones on entry and on exit."""
    marks[0] = lo
    marks.index_add_(0, at, increments)
    torch.cumsum(marks[: pos.shape[0]], 0, out=pos)
    marks.index_fill_(0, at, 1)
    return pos


@hot_path
def _chunk_block(flat: torch.Tensor, first: int, n: int, buf: torch.Tensor) -> torch.Tensor:
    """Chunks ``n`` from byte ``first`` of ``flat`` (uint8) as int64 [n]: a view when
    they lie on an 8-byte boundary inside ``flat``, else copied into ``buf`` (uint8, at
    least ``8 n`` bytes) and zero-padded past the end of ``flat``."""
    last = min(first + 8 * n, flat.shape[0])
    src = flat[first:last]
    if last - first == 8 * n and _aligned(src):
        return src.view(torch.int64)
    buf[: last - first].copy_(src)
    buf[last - first : 8 * n].zero_()
    return buf[: 8 * n].view(torch.int64)


@hot_path
def _segment_sums(
    flat: torch.Tensor, shift: int, starts: torch.Tensor, ends: torch.Tensor, bound: int
) -> torch.Tensor:
    """Wrapping int64 sums of the transformed chunks ``[starts[r], ends[r])`` per row ``r``
    of the bytes ``flat[shift:]`` read as 8-byte chunks (zero-padded at the end); chunk
    positions count from each row's start. Rows are sorted and do not overlap; an empty
    row that must not restart the positions repeats the previous row's start. Positions
    below ``bound`` come from the weight table.

    Chunks run in blocks (fixed by the static shape). A chunk's index in its row is a
    cumulative sum (:func:`_positions_in_rows`: no row ids, no search), its weight a
    gather from the cached table. Row sums are differences of the cumulative sum of the
    transformed chunks at the row bounds, so chunks in no row drop out without a mask.
    Integer sums wrap and are exact in any order (also on a GPU).
    """
    device = flat.device
    total = -(-(flat.shape[0] - shift) // 8)
    rows = starts.shape[0]
    table = _weight_table(device, bound) if bound <= _TABLE_MAX_POSITIONS else None
    step = _block_chunks(device)
    size = min(step, total)
    increments = -torch.diff(starts, prepend=starts.new_zeros(1))
    bounds = torch.stack([starts, ends])
    buf = _scratch("pad", device, torch.uint8, 8 * size)
    marks = _scratch("marks", device, torch.int64, size + 1).fill_(1)
    pos_buf = _scratch("t", device, torch.int64, size)
    u = _scratch("u", device, torch.int64, size)
    csum = _scratch("csum", device, torch.int64, size + 1)
    csum[0] = 0  # stays 0: the cumulative sums fill csum[1:]
    at_bounds = torch.zeros(2, rows, device=device, dtype=torch.int64)
    for lo in range(0, total, step):
        n = min(step, total - lo)
        at = (bounds - lo).clamp_(0, n)
        pos = _positions_in_rows(pos_buf[:n], marks, at[0], increments, lo)
        w = _position_weights(pos, table, bound < total, u[:n])
        chunks = _chunk_block(flat, shift + 8 * lo, n, buf)
        _transform_into(chunks, w, csum[1 : n + 1], u[:n])
        csum[1 : n + 1].cumsum_(0)
        at_bounds += csum.index_select(0, at.view(-1)).view(2, rows)
    return at_bounds[1] - at_bounds[0]


@hot_path
def _tail_correction(
    flat: torch.Tensor, first: torch.Tensor, nbytes: torch.Tensor, nchunks: torch.Tensor
) -> torch.Tensor:
    """Per row: the transformed last chunk as it should be (the row's bytes, zero-padded)
    minus as :func:`_segment_sums` read it (with the bytes that follow the row)."""
    lane = torch.arange(8, device=flat.device, dtype=torch.int64)
    index = (first + 8 * (nchunks - 1).clamp_(min=0)).unsqueeze(1) + lane  # [rows, 8]
    read = (index < flat.shape[0]) & (nchunks > 0).unsqueeze(1)
    own = read & (index < (first + nbytes).unsqueeze(1))
    raw = flat.index_select(0, index.clamp_(0, max(flat.shape[0] - 1, 0)).view(-1))
    raw = raw.view(index.shape).to(torch.int64) << (8 * lane)
    w = _weights((nchunks - 1).clamp_(min=0))
    as_read = (raw * read).sum(dim=1)
    as_owned = (raw * own).sum(dim=1)
    return _transform(as_owned, w) - _transform(as_read, w)


@hot_path
def _general_jagged_sums(
    values: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, max_len: int | None
) -> torch.Tensor:
    """Row sums of rows ``values[starts[r] : starts[r] + lengths[r]]`` of a jagged field.

    A row's chunks start at its first byte, which need not sit on an 8-byte boundary of
    the value bytes. Rows are grouped by that offset modulo 8 (``8 / gcd(value bytes, 8)``
    groups, a static loop); each group reads the bytes from its offset on as chunks, so
    every chunk is aligned to the rows of its group, and sums only those rows (the others
    empty, not restarting positions). A row's last chunk was read with the bytes that
    follow it; :func:`_tail_correction` swaps in the zero-padded one.
    """
    rows = starts.shape[0]
    value_bytes = math.prod(values.shape[1:]) * values.element_size()
    sums = torch.zeros(rows, device=values.device, dtype=torch.int64)
    if rows == 0 or value_bytes == 0 or values.shape[0] == 0:
        return sums
    flat = _byte_rows(values).view(-1)
    first = starts * value_bytes
    nbytes = lengths * value_bytes
    nchunks = (nbytes + 7) // 8
    for shift in range(0, 8, math.gcd(value_bytes, 8)):
        if shift >= flat.shape[0]:
            break
        group = first % 8 == shift
        head = (first - shift) // 8
        start = torch.cummax(torch.where(group, head, 0), dim=0).values
        end = torch.where(group, head + nchunks, start)
        total = -(-(flat.shape[0] - shift) // 8)
        bound = total if max_len is None else min(total, -(-max_len * value_bytes // 8))
        sums += _segment_sums(flat, shift, start, end, bound)
    return sums + _tail_correction(flat, first, nbytes, nchunks)
