"""Fields for the integrity tests (test_integrity.py, test_digest_reference.py): random
data of every digestible dtype, and digests computed under the sync guard."""

from __future__ import annotations

import torch

from syncless.dataplane.integrity import row_digests
from syncless.guard import no_sync


def digests(field: torch.Tensor) -> torch.Tensor:
    """row_digests under the sync guard (proves the hot path is sync-free)."""
    with no_sync(cpu_as_device=True):
        return row_digests(field)


def jagged(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def single(row: torch.Tensor) -> int:
    """Ground truth: the digest of one row digested alone, as a Python int."""
    return int(digests(row.unsqueeze(0))[0])


FLOAT8 = [
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
]
DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
    *FLOAT8,
]


def make(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random data of ``dtype`` with varied bit patterns (float8 via random bytes)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype in FLOAT8:
        # random bytes, avoiding NaN encodings is unnecessary: digests see bits only
        return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8).view(dtype)
    if dtype.is_complex or dtype.is_floating_point:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 10).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)
