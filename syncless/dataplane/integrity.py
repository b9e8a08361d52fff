"""Order-aware per-row digests computed on the device (the data plane's wire-hash guard).

An RL data plane puts batches of tensors (fields) keyed by row into a key-value store and
another process gets them back -- dense on put, possibly jagged nested
(``layout=torch.jagged``) on get. To prove that every row that comes out is the row that
went in, the writer computes one int64 digest per row with :func:`row_digests` and puts it
as a mirror field in the same put; the reader recomputes the digests of what it got and
compares them with :func:`verify_rows`. Nothing else travels: no side state, no Python
``hash()`` (salted per process), only fixed constants, so digests agree across processes
and machines.

The digest scheme
-----------------
For a row of shape ``(d1, ..., dk)`` and dtype ``D``:

1. **Chunks.** The row's bytes -- its elements in row-major order, each as stored in
   memory (complex as real then imaginary part, bool as one byte) -- are cut into 8-byte
   chunks counted from the row's first byte, the last one zero-padded, and chunk ``k`` is
   read as a little-endian 64-bit integer ``c_k`` (every platform torch trains on is
   little-endian; the digest assumes it). Chunks count from the row's start, not from
   an address, so the dense ``[N, L]`` field and its jagged version give the same chunks.
   Versions before the chunks digested one element (complex: one part) per word: rows
   of float64, int64, uint64 and complex128 keep those digests, other rows changed.
2. **Position weighting.** Chunk ``k`` is multiplied by an odd pseudo-random weight
   ``w_k = mix64(k * G + C) | 1`` (``mix64`` = the splitmix64 finaliser, ``G`` its
   golden-ratio increment; wrapping int64 arithmetic), then passed through the bijection
   ``t -> (t ^ (t >>> 29)) * K`` (``>>>`` = logical shift, done in int64 as an arithmetic
   shift plus mask, because uint64 ops are limited in torch).
3. **Sum.** The transformed chunks are summed per row (int64, wrapping). Multiplication by
   ``K`` distributes over the wrapping sum, so the code sums ``t ^ (t >>> 29)`` and
   multiplies each row's sum by ``K`` once: the same digest with one pass fewer per chunk.
4. **Salt and avalanche.** The row sum is xored with a per-row salt (the dtype's fixed
   code, the row's rank and every dimension of the row's shape, the jagged length
   included -- which also tells a row from the same row with zero elements appended,
   whose chunks are the same) and finished with the splitmix64 finaliser.

Properties (what it catches and what it does not):

- It is a **64-bit non-cryptographic checksum**, not a MAC: anyone can forge a row with a
  given digest. It catches accidents (wrong row, wrong sample, truncation, conversion,
  reordering, corruption), not adversaries.
- Any change confined to **one element** (for complex128, to its real or its imaginary
  part) is caught with certainty: element widths 1, 2, 4 and 8 divide 8 and elements sit
  at multiples of their width from the row's start, so an element lies in one chunk;
  the weight is odd (invertible mod 2^64), the chunk transform and the finaliser are
  bijections.
- Any change of the **dtype** (even at the same width with identical bits, e.g. int32 vs
  float32 bitcast-equal) or of the **row shape/length** is caught with certainty up to a
  64-bit collision of the salts (the salt enters through a bijective finaliser).
- **Order-aware**: weights differ per chunk and a chunk keeps its bytes in order, so a
  permutation within a row, two rows swapped or a row from the wrong sample change the
  digest; unlike an XOR fold, equal elements do not cancel in pairs (``[7, 7, 7, 7] ->
  [0, 0, 0, 0]`` is caught).
- Other multi-element corruption is caught with probability about 1 - 2^-64 per row
  (heuristic: the per-chunk transform is nonlinear, so structured differences such as
  sign-bit flips do not line up with the 2-adic structure of the weights).
- Digests are identical whether a row travels dense or jagged, whatever its position in
  the batch and however the batch is split into shards.

How the sum is computed (no Python loop over rows, nothing read from the device on the
host; every path gives the digest above, which the tests check against a pure-Python
version of it):

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
numbers: ``bench/dataplane_integrity.py`` and ``bench/RESULTS.md``. On an accelerator
the temporaries are a few int64 tensors of at most 2^26 chunks each.

Counters (design for the caller; the data plane wrapper owns them)
-------------------------------------------------------------------
:func:`verify_rows` returns device tensors and never syncs; the wrapper accumulates them
on the device and reads them at flush with everything else. Per step it reports:

- ``rows_checked_count``: rows whose digest was recomputed and compared;
- ``mismatch_count``: rows whose digest differed (the only "error" counter);
- ``rows_unverified_count``: rows that came back without a mirror digest (a field or key
  put without one), so "0 mismatches" never means "not looked at";
- ``fields_skipped_count``: fields the guard cannot digest (non-tensor payloads);
- ``guard_failures_count``: exceptions raised inside the guard -- counted, never raised
  into the training step;
- a step with ``mismatch_count == rows_checked_count > 0`` is flagged
  ``suspect_check`` ("more likely a bug in the check than in the wire": a wire that
  corrupts every single row is rarer than a digest computed on the wrong field or dtype).

:func:`xor_fold_digests` (``torch.hash_tensor``) and :func:`crc32_digests` (``zlib`` on
the host) are baselines for ``bench/dataplane_integrity.py``, not guards.
"""

from __future__ import annotations

import itertools
import math
import threading
import zlib
from dataclasses import dataclass

import torch

from syncless.hot_path import hot_path

__all__ = [
    "DTYPE_CODES",
    "IntegrityResult",
    "crc32_digests",
    "row_digests",
    "summarize",
    "verify_rows",
    "xor_fold_digests",
]


def _s64(x: int) -> int:
    """A 64-bit constant as the signed int64 with the same bits (torch has no uint64 math)."""
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >= 1 << 63 else x


# splitmix64 constants (Steele, Lea, Flood 2014); fixed forever: changing any of them
# changes every digest, and writers and readers of different versions would disagree.
_GOLDEN = _s64(0x9E3779B97F4A7C15)
_M1 = _s64(0xBF58476D1CE4E5B9)
_M2 = _s64(0x94D049BB133111EB)
# Word transform multiplier and the offsets that separate the weight and salt streams.
_K_WORD = _s64(0xD6E8FEB86659FD93)
_C_WEIGHT = _s64(0x243F6A8885A308D3)  # pi
_C_SALT = _s64(0x13198A2E03707344)
_C_XOR = _s64(0xA4093822299F31D0)

# Fixed dtype codes: part of the wire format (never derived from hash() or dict order).
DTYPE_CODES: dict[torch.dtype, int] = {}
for _code, _name in enumerate(
    [
        "bool",
        "uint8",
        "int8",
        "int16",
        "int32",
        "int64",
        "float16",
        "bfloat16",
        "float32",
        "float64",
        "complex32",
        "complex64",
        "complex128",
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
    ],
    start=1,
):
    if hasattr(torch, _name):  # older torch builds lack some float8 types
        DTYPE_CODES[getattr(torch, _name)] = _code

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


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 ``z`` by ``s`` (``>>`` on int64 is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


@hot_path
def _mix64(z: torch.Tensor) -> torch.Tensor:
    """The splitmix64 finaliser in wrapping int64 arithmetic (a bijection on 64 bits)."""
    z = (z ^ _srl(z, 30)) * _M1
    z = (z ^ _srl(z, 27)) * _M2
    return z ^ _srl(z, 31)


@hot_path
def _weights(pos: torch.Tensor) -> torch.Tensor:
    """Odd pseudo-random int64 weight of each chunk position (a fixed function of ``pos``)."""
    return _mix64(pos * _GOLDEN + _C_WEIGHT) | 1


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


def _dtype_code(dtype: torch.dtype) -> int:
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise TypeError(f"row_digests: dtype {dtype} has no fixed digest code")
    return code


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


@hot_path
def _salted(
    sums: torch.Tensor, code: int, first: int | torch.Tensor | None, rest: tuple[int, ...]
) -> torch.Tensor:
    """Finish the row sums: mix in dtype code and row shape ``(first, *rest)`` (``first``
    is None for rows of rank 0, a tensor of per-row lengths for jagged rows), then
    avalanche. Dense and jagged rows of the same shape get the same salt."""
    rank = len(rest) + (0 if first is None else 1)
    salt = torch.full_like(sums, _s64(code * 0x100 + rank) ^ _C_SALT)
    salt = _mix64(salt)
    if first is not None:
        salt = _mix64(salt + first)
    for dim in rest:  # static shape metadata: a handful of tiny [rows] ops, no sync
        salt = _mix64(salt + dim)
    return _mix64(sums.mul_(_K_WORD) ^ salt)


@hot_path
def _transform_into(
    chunks: torch.Tensor, w: torch.Tensor, t: torch.Tensor, u: torch.Tensor
) -> None:
    """``t = c ^ (c >>> 29)`` with ``c = chunks * w`` (wrapping int64), into the
    preallocated ``t`` (``u`` is scratch of the same shape; ``w`` may alias it). The
    scheme's ``* K`` is applied to the row sums (:func:`_salted`): multiplication by a
    constant distributes over the wrapping sum, so the digest is the same with one pass
    fewer per chunk."""
    torch.mul(chunks, w, out=t)
    torch.bitwise_right_shift(t, 29, out=u)
    u &= (1 << 35) - 1  # logical shift: drop the sign copies of the arithmetic one
    t ^= u


@hot_path
def _transform(chunks: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """:func:`_transform_into` for a few chunks (fresh tensors)."""
    t = chunks * w
    return t ^ _srl(t, 29)


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


def _uniform_seqlen(field: torch.Tensor) -> int | None:
    """The common row length of a jagged ``field`` whose rows tile ``_values`` from index
    0, else None; from host metadata only (see the module docstring)."""
    if field._lengths is not None:
        return None
    low = getattr(field, "_maybe_min_seqlen", None)
    high = getattr(field, "_maybe_max_seqlen", None)
    rows = field._offsets.shape[0] - 1
    if low is None or low != high or field._values.shape[0] != rows * high:
        return None
    return int(high)


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


@hot_path
def _dense_digests(field: torch.Tensor) -> torch.Tensor:
    code = _dtype_code(field.dtype)
    row_shape = tuple(field.shape[1:])
    sums = _dense_sums(_byte_rows(field))
    if row_shape:
        return _salted(sums, code, row_shape[0], row_shape[1:])
    return _salted(sums, code, None, ())


@hot_path
def _jagged_digests(field: torch.Tensor) -> torch.Tensor:
    if field._ragged_idx != 1:
        raise ValueError(
            f"row_digests: jagged tensors must be ragged in dim 1, got {field._ragged_idx}"
        )
    values = field._values
    offsets = field._offsets
    code = _dtype_code(values.dtype)
    inner = tuple(values.shape[1:])
    rows = offsets.shape[0] - 1
    seqlen = _uniform_seqlen(field)
    if seqlen is not None:  # the rows are the dense [rows, seqlen, *inner] layout
        value_bytes = _byte_rows(values)
        sums = _dense_sums(value_bytes.reshape(rows, seqlen * value_bytes.shape[1]))
        return _salted(sums, code, seqlen, inner)
    starts = offsets[:-1]
    # A non-contiguous NJT (holes) has explicit lengths; a narrowed one has values beyond
    # offsets[-1]. Both are handled by summing only [start, start + length) of each row.
    lengths = offsets[1:] - starts if field._lengths is None else field._lengths
    max_len = getattr(field, "_maybe_max_seqlen", None)
    max_len = None if max_len is None else int(max_len)
    return _salted(_general_jagged_sums(values, starts, lengths, max_len), code, lengths, inner)


@hot_path
def row_digests(field: torch.Tensor) -> torch.Tensor:
    """One int64 digest per row of ``field`` (rows = first dim), on ``field``'s device.

    ``field`` is a dense tensor of any dtype (rows of shape ``field.shape[1:]``) or a
    jagged nested tensor (``layout=torch.jagged``, ragged in dim 1; rows may differ in
    length). A dense ``[N, L, ...]`` field and its jagged version give the same digests.
    Device ops only: no sync, no data-dependent shapes, no Python loop over rows.
    """
    if field.is_nested:
        return _jagged_digests(field)
    if field.dim() == 0:
        raise ValueError("row_digests: a 0-d tensor has no rows")
    return _dense_digests(field)


@dataclass(frozen=True)
class IntegrityResult:
    """Device-side outcome of :func:`verify_rows`; read it at flush (:func:`summarize`)."""

    rows: int  # static: the field's row count
    digests: torch.Tensor  # int64 [rows], recomputed from the field
    mismatch: torch.Tensor  # bool [rows], True where the digest differs from expected
    mismatch_count: torch.Tensor  # int64 0-d, on the device


@hot_path
def verify_rows(field: torch.Tensor, expected: torch.Tensor) -> IntegrityResult:
    """Recompute ``field``'s row digests and compare them with ``expected`` on the device.

    ``expected`` is the int64 ``[rows]`` mirror field the writer put with the data. No
    sync: the result holds device tensors; shape mismatches (static metadata) raise
    ``ValueError``, which the caller's guard counts as a guard failure.
    """
    digests = row_digests(field)
    if expected.shape != digests.shape or expected.dtype != torch.int64:
        raise ValueError(
            f"verify_rows: expected digests must be int64 {tuple(digests.shape)}, "
            f"got {expected.dtype} {tuple(expected.shape)}"
        )
    mismatch = digests != expected.to(digests.device, non_blocking=True)
    return IntegrityResult(
        rows=digests.shape[0],
        digests=digests,
        mismatch=mismatch,
        mismatch_count=mismatch.sum(),
    )


def summarize(result: IntegrityResult, max_rows: int = 32) -> dict[str, object]:
    """Host-side summary of one :class:`IntegrityResult` (cold path: syncs, call at flush).

    Returns ``rows_checked``, ``mismatches``, up to ``max_rows`` ``mismatched_rows``
    (batch indices) and ``suspect_check``: every row mismatched, which is more likely a
    bug in the check (wrong field, dtype or digest version) than in the wire.
    """
    mismatches = int(result.mismatch_count.item())
    bad = result.mismatch.nonzero().flatten()[:max_rows].cpu().tolist() if mismatches else []
    return {
        "rows_checked": result.rows,
        "mismatches": mismatches,
        "mismatched_rows": bad,
        "suspect_check": result.rows > 0 and mismatches == result.rows,
    }


def _bitcast_for_hash(x: torch.Tensor) -> torch.Tensor:
    """What ``torch.hash_tensor`` accepts: complex as float pairs, float8 as uint8."""
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype.is_floating_point and x.element_size() == 1:
        x = x.view(torch.uint8)
    return x


def xor_fold_digests(field: torch.Tensor) -> torch.Tensor:
    """Baseline: ``torch.hash_tensor`` XOR fold per row, salted with the dtype code.

    Dense fields only. Order-blind and cancels equal pairs (``[7, 7, 7, 7]`` and
    ``[0, 0, 0, 0]`` both fold to 0); values are upcast to 64 bits before the fold, so
    the dtype salt is what tells fp16 from fp32 holding the same numbers.
    """
    if field.is_nested:
        raise TypeError("xor_fold_digests: dense tensors only (the baseline has no segments)")
    rows = field.shape[0]
    flat = _bitcast_for_hash(field.contiguous()).reshape(rows, -1)
    folded = torch.hash_tensor(flat, dim=1).view(torch.int64)
    return folded ^ _s64(_dtype_code(field.dtype) * _C_XOR)


def crc32_digests(field: torch.Tensor) -> torch.Tensor:
    """Baseline: ``zlib.crc32`` of each row's bytes on the host (cold path; syncs).

    Seeded with the dtype code and row shape. Dense or jagged (offsets read on the host).
    Returns int64 ``[rows]`` on the CPU.
    """
    if field.is_nested:
        values = field._values.detach().cpu().contiguous()
        offsets = field._offsets.cpu().tolist()
        lengths = None if field._lengths is None else field._lengths.cpu().tolist()
        rows = [
            values[s : s + (e - s if lengths is None else lengths[i])]
            for i, (s, e) in enumerate(itertools.pairwise(offsets))
        ]
    else:
        rows = list(field.detach().cpu().contiguous())
    out = []
    for row in rows:
        salt = f"{_dtype_code(row.dtype)}:{tuple(row.shape)}".encode()
        data = row.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        out.append(zlib.crc32(data, zlib.crc32(salt)))
    return torch.tensor(out, dtype=torch.int64)
