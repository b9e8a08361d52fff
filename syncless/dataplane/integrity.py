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

1. **Words.** The row's elements are reinterpreted bit-for-bit as signed integers of the
   same width (``.view``: float32 -> int32, bfloat16 -> int16, float8/bool/uint8 -> uint8,
   complex -> its real/imag float pairs) and widened to int64 -- one word per element, in
   row-major order. Words are per element, not per 8 bytes, so a row's words do not
   depend on where it sits in memory: the dense ``[N, L]`` field and its jagged version
   give the same words.
2. **Position weighting.** Word ``e`` of the row is multiplied by an odd pseudo-random
   weight ``w_e = splitmix64(e + C) | 1`` (wrapping int64 arithmetic), then passed through
   the bijection ``t -> (t ^ (t >>> 29)) * K`` (``>>>`` = logical shift, done in int64 as
   an arithmetic shift plus mask, because uint64 ops are limited on CUDA).
3. **Sum.** The transformed words are summed per row (int64, wrapping): ``sum(dim=1)`` for
   dense fields; for jagged fields a per-position sum followed by a segment sum over the
   offsets (a cumulative-sum difference), so rows of any lengths are handled in one pass
   without a Python loop over rows and without reading the offsets on the host.
4. **Salt and avalanche.** The row sum is xored with a per-row salt (the dtype's fixed
   code, the row's rank and every dimension of the row's shape, the jagged length
   included) and finished with the splitmix64 finaliser.

Properties (what it catches and what it does not):

- It is a **64-bit non-cryptographic checksum**, not a MAC: anyone can forge a row with a
  given digest. It catches accidents (wrong row, wrong sample, truncation, conversion,
  reordering, corruption), not adversaries.
- Any change confined to **one word** (element) is caught with certainty: the weight is
  odd (invertible mod 2^64), the word transform and the finaliser are bijections.
- Any change of the **dtype** (even at the same width with identical bits, e.g. int32 vs
  float32 bitcast-equal) or of the **row shape/length** is caught with certainty up to a
  64-bit collision of the salts (the salt enters through a bijective finaliser).
- **Order-aware**: weights differ per position, so a permutation within a row, two rows
  swapped or a row from the wrong sample change the digest; unlike an XOR fold, equal
  words do not cancel in pairs (``[7, 7, 7, 7] -> [0, 0, 0, 0]`` is caught).
- Other multi-word corruption is caught with probability about 1 - 2^-64 per row
  (heuristic: the per-word transform is nonlinear, so structured differences such as
  sign-bit flips do not line up with the 2-adic structure of the weights).
- Digests are identical whether a row travels dense or jagged, whatever its position in
  the batch and however the batch is split into shards.

Cost: a few elementwise passes over the field widened to int64 (see
``bench/dataplane_integrity.py`` and ``bench/RESULTS.md``); the int64 temporaries are 2-8x
the field's bytes. Dense fields need the weights of one row only; jagged fields compute a
weight per element.

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

# Elements per block of the word transform: on a CPU the int64 temporaries of a block
# (512 KiB) stay in cache; on an accelerator typical fields are one block (fewer launches).
_BLOCK_ELEMS_CPU = 1 << 16
_BLOCK_ELEMS_DEVICE = 1 << 26

# Signed integer dtype of each element width: the bit-for-bit "word" view.
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
    """Odd pseudo-random int64 weight of each word position (a fixed function of ``pos``)."""
    return _mix64(pos * _GOLDEN + _C_WEIGHT) | 1


@hot_path
def _words(x: torch.Tensor) -> torch.Tensor:
    """``x`` (contiguous) reinterpreted as integer words of its element width, one per
    element; complex becomes its float pairs. Returns uint8/int16/int32/int64 (not widened:
    the caller's multiply widens in the same pass)."""
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.dtype == torch.bool:
        return x.view(torch.uint8)
    width = x.element_size()
    return x.view(_INT_OF_WIDTH[width])


def _dtype_code(dtype: torch.dtype) -> int:
    code = DTYPE_CODES.get(dtype)
    if code is None:
        raise TypeError(f"row_digests: dtype {dtype} has no fixed digest code")
    return code


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
    return _mix64(sums ^ salt)


@hot_path
def _transform(words: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Weighted, nonlinearly transformed int64 words: ``t = word * w; (t ^ t>>>29) * K``."""
    t = words * w  # promotes to int64 in the same pass (w is int64)
    t ^= _srl(t, 29)
    t *= _K_WORD
    return t


def _block_rows(device: torch.device, row_elems: int) -> int:
    """Rows per block so that one block's int64 temporaries stay small (static shapes only)."""
    target = _BLOCK_ELEMS_CPU if device.type == "cpu" else _BLOCK_ELEMS_DEVICE
    return max(1, target // max(1, row_elems))


@hot_path
def _dense_digests(field: torch.Tensor) -> torch.Tensor:
    rows = field.shape[0]
    code = _dtype_code(field.dtype)
    row_shape = tuple(field.shape[1:])
    words = _words(field.contiguous()).reshape(rows, -1)
    w = _weights(torch.arange(words.shape[1], device=field.device, dtype=torch.int64))
    sums = torch.empty(rows, device=field.device, dtype=torch.int64)
    step = _block_rows(field.device, words.shape[1])
    # Blocks of rows (a loop fixed by the static shape, not by the data): the int64
    # temporaries of one block stay in cache on a CPU (about 8x faster than one pass over
    # the whole field); on an accelerator a block is normally the whole field.
    for lo in range(0, rows, step):
        sums[lo : lo + step] = _transform(words[lo : lo + step], w).sum(dim=1)
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
    lengths = field._lengths
    code = _dtype_code(values.dtype)
    inner = tuple(values.shape[1:])
    device = values.device
    total = values.shape[0]
    starts = offsets[:-1]
    # A non-contiguous NJT (holes) has explicit lengths; a narrowed one has values beyond
    # offsets[-1]. Both are handled by summing only [start, end) of each row.
    ends = offsets[1:] if lengths is None else starts + lengths
    lens = ends - starts
    words = _words(values.contiguous()).reshape(total, -1)
    per_pos = words.shape[1]
    inner_pos = torch.arange(per_pos, device=device, dtype=torch.int64)
    sums = torch.zeros(starts.shape[0], device=device, dtype=torch.int64)
    ones = torch.ones_like(starts)
    step = _block_rows(device, per_pos)
    # Blocks of value positions (see _dense_digests); everything per position is computed
    # inside the block so no [total]-sized temporary is materialised.
    for lo in range(0, total, step):
        hi = min(lo + step, total)
        j = torch.arange(lo, hi, device=device, dtype=torch.int64)
        # row(j) = #{starts <= j} - 1, counted by a histogram of the starts clamped into
        # the block and a cumsum (cheaper than a searchsorted per position on a CPU).
        # Positions in no row (before offsets[0], past offsets[-1], or in a hole of a
        # non-contiguous NJT) get a nearby row and are masked out of the segment sum.
        marks = torch.zeros(hi - lo + 1, device=device, dtype=torch.int64)
        marks.index_add_(0, (starts - lo).clamp_(0, hi - lo), ones)
        row = (marks[:-1].cumsum(0) - 1).clamp_(min=0)
        pos = j - starts.index_select(0, row)
        inside = (pos >= 0) & (pos < lens.index_select(0, row))
        w = _weights(pos.clamp_(min=0).unsqueeze(1) * per_pos + inner_pos)
        per_value = _transform(words[lo:hi], w).sum(dim=1) * inside
        # Integer segment sum: wrapping int64 addition is associative, so the result is
        # exact and deterministic in any order (also with atomics on a GPU).
        sums.index_add_(0, row, per_value)
    return _salted(sums, code, lens, inner)


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
