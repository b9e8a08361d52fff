"""Baseline per-row digests for ``bench/dataplane/integrity.py``, not guards.

:func:`xor_fold_digests` (``torch.hash_tensor``) and :func:`crc32_digests` (``zlib`` on
the host) are what the order-aware digest of :mod:`syncless.dataplane.integrity` is
measured against.
"""

from __future__ import annotations

import itertools
import zlib

import torch

from syncless.dataplane.digest_scheme import _C_XOR, _dtype_code, _s64

__all__ = ["crc32_digests", "xor_fold_digests"]


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
