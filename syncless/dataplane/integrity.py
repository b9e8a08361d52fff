"""Order-aware per-row digests computed on the device (the data plane's wire-hash guard).

An RL data plane puts batches of tensors (fields) keyed by row into a key-value store and
another process gets them back -- dense on put, possibly jagged nested
(``layout=torch.jagged``) on get. To prove that every row that comes out is the row that
went in, the writer computes one int64 digest per row with :func:`row_digests` and puts it
as a mirror field in the same put; the reader recomputes the digests of what it got and
compares them with :func:`verify_rows`. Nothing else travels: no side state, no Python
``hash()`` (salted per process), only fixed constants, so digests agree across processes
and machines.

The guard is split over four modules:

- this one: :func:`row_digests` (dense or jagged fields), :func:`verify_rows` and
  :func:`summarize`, and the counters below;
- :mod:`syncless.dataplane.digest_scheme`: the digest itself (the scheme, its constants
  and dtype codes) and what it catches and what it does not;
- :mod:`syncless.dataplane.digest_sums`: how the per-row sums are computed on the device
  (dense and jagged paths, block buffers, the weight table) and what that costs;
- :mod:`syncless.dataplane.digest_baselines`: the baselines below.

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
the host) are baselines for ``bench/dataplane/integrity.py``, not guards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from syncless.dataplane.digest_baselines import crc32_digests, xor_fold_digests
from syncless.dataplane.digest_scheme import DTYPE_CODES, _dtype_code, _salted
from syncless.dataplane.digest_sums import _byte_rows, _dense_sums, _general_jagged_sums
from syncless.hot_path import hot_path

# DTYPE_CODES and the baselines are defined next door; importable from here too.
__all__ = [
    "DTYPE_CODES",
    "IntegrityResult",
    "crc32_digests",
    "row_digests",
    "summarize",
    "verify_rows",
    "xor_fold_digests",
]


def _uniform_seqlen(field: torch.Tensor) -> int | None:
    """The common row length of a jagged ``field`` whose rows tile ``_values`` from index
    0, else None; from host metadata only (see :mod:`syncless.dataplane.digest_sums`)."""
    if field._lengths is not None:
        return None
    low = getattr(field, "_maybe_min_seqlen", None)
    high = getattr(field, "_maybe_max_seqlen", None)
    rows = field._offsets.shape[0] - 1
    if low is None or low != high or field._values.shape[0] != rows * high:
        return None
    return int(high)


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
