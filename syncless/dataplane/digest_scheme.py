"""The per-row digest of the data plane's wire-hash guard: the scheme and its constants.

Everything here is wire format: the constants, the dtype codes and the steps below fix
every digest, so writers and readers must run the same version.
:func:`~syncless.dataplane.integrity.row_digests` computes the digest of each row of a
field; the per-row sums of step 3 are computed on the device by
:mod:`syncless.dataplane.digest_sums`. This module holds the arithmetic of the other
steps (the finaliser, the chunk weights and transform, the salt).

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
"""

from __future__ import annotations

import torch

from syncless.hot_path import hot_path

__all__ = ["DTYPE_CODES"]


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


# Marked: row_digests (integrity.py) calls it in the step, and `syncless lint` follows
# calls within one module only.
@hot_path
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
