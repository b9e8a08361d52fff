"""Tests for syncless.dataplane.integrity: order-aware per-row digests.

Ground truth is independent of the batch digest: each row's expected digest is the digest
of the unmodified row computed on its own (a one-row batch), and "caught" means the
modified row's digest differs from it. The scheme itself is pinned in
test_digest_reference.py. Every digest computation runs under
``no_sync(cpu_as_device=True)``.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from integrity_fields import DTYPES, FLOAT8, digests, jagged, make, single

from syncless.dataplane.integrity import (
    DTYPE_CODES,
    crc32_digests,
    summarize,
    verify_rows,
    xor_fold_digests,
)
from syncless.guard import no_sync


def change_one(x: torch.Tensor, idx: int) -> torch.Tensor:
    """A copy of 1-D ``x`` with element ``idx`` changed (one bit flipped in its bytes)."""
    y = x.clone()
    raw = y.view(torch.uint8)  # shares storage: flipping a byte changes y
    width = raw.numel() // y.numel()
    raw[idx * width] ^= 1
    return y


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_changed_element_caught_in_every_dtype(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    field = make(dtype, (6, 11), gen)
    truth = [single(r) for r in field]
    for row in range(6):
        for idx in (0, 5, 10):
            bad = field.clone()
            bad[row] = change_one(field[row], idx)
            got = digests(bad)
            assert int(got[row]) != truth[row], (dtype, row, idx)
            others = [i for i in range(6) if i != row]
            assert got[others].tolist() == [truth[i] for i in others]


def test_truncated_jagged_row_and_zeroed_row() -> None:
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randn(n, generator=gen) for n in (5, 8, 3)]
    truth = [single(r) for r in rows]
    short = digests(jagged([rows[0], rows[1][:7], rows[2]]))
    assert short.tolist()[0] == truth[0] and short.tolist()[2] == truth[2]
    assert int(short[1]) != truth[1]
    zeroed = digests(jagged([rows[0], torch.zeros(8), rows[2]]))
    assert int(zeroed[1]) != truth[1]
    # a zero-length row and rows of zeros of different lengths are all distinct
    zs = digests(jagged([torch.zeros(0), torch.zeros(1), torch.zeros(2), torch.zeros(4)]))
    assert len(set(zs.tolist())) == 4


def test_bf16_to_fp32_conversion_caught() -> None:
    x = torch.randn(4, 16).to(torch.bfloat16)
    assert (digests(x) != digests(x.float())).all()
    # the XOR fold upcasts to 64 bits: without its dtype salt it could not tell them apart
    raw16 = torch.hash_tensor(x.reshape(4, -1), dim=1)
    raw32 = torch.hash_tensor(x.float().reshape(4, -1), dim=1)
    assert torch.equal(raw16, raw32)


def test_same_width_dtype_change_caught() -> None:
    x = torch.randn(5, 7)
    bits = x.view(torch.int32)  # identical bytes, different dtype
    assert (digests(x) != digests(bits)).all()
    u = torch.randint(0, 127, (3, 9), dtype=torch.uint8)
    assert (digests(u) != digests(u.view(torch.int8))).all()


def test_wrong_sample_and_swapped_rows_caught() -> None:
    gen = torch.Generator().manual_seed(3)
    field = torch.randn(8, 32, generator=gen)
    truth = [single(r) for r in field]
    swapped = field[[1, 0, *range(2, 8)]]  # rows of keys 0 and 1 served swapped
    got = digests(swapped).tolist()
    assert got[0] != truth[0] and got[1] != truth[1]
    assert got[2:] == truth[2:]
    wrong = field.clone()
    wrong[5] = field[2]  # key 5 served key 2's sample
    res = verify_rows_guarded(wrong, torch.tensor(truth))
    s = summarize(res)
    assert s["mismatches"] == 1 and s["mismatched_rows"] == [5] and not s["suspect_check"]


def verify_rows_guarded(field: torch.Tensor, expected: torch.Tensor):
    with no_sync(cpu_as_device=True):
        return verify_rows(field, expected)


def test_permutation_inside_row_caught() -> None:
    gen = torch.Generator().manual_seed(4)
    field = torch.randn(50, 40, generator=gen)
    truth = digests(field)
    perm = torch.stack([torch.randperm(40, generator=gen) for _ in range(50)])
    permuted = torch.gather(field, 1, perm)
    assert (digests(permuted) != truth).all()
    # adjacent swap, and the symmetric [a, b, b, a] -> [b, a, a, b] (zero first moment)
    for row in (torch.tensor([1, 2, 3, 4]), torch.tensor([5, 9, 9, 5])):
        swapped = row[[1, 0, 3, 2]]
        assert single(swapped) != single(row)
    # swap of two fp64 values that differ only in the sign bit (bit 63)
    v = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    assert single(v[[1, 0, 2]]) != single(v)


def test_constant_even_row_zeroed_xor_fold_misses() -> None:
    sevens = torch.tensor([[7, 7, 7, 7]], dtype=torch.int64)
    zeros = torch.zeros_like(sevens)
    assert torch.equal(xor_fold_digests(sevens), xor_fold_digests(zeros))  # the blind spot
    assert not torch.equal(digests(sevens), digests(zeros))
    assert not torch.equal(crc32_digests(sevens), crc32_digests(zeros))
    # XOR is also order-blind; ours is not
    row = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    flipped = row.flip(1)
    assert torch.equal(xor_fold_digests(row), xor_fold_digests(flipped))
    assert not torch.equal(digests(row), digests(flipped))


def test_verify_rows_all_mismatch_flagged_suspect() -> None:
    x = torch.randn(4, 8)
    res = verify_rows_guarded(x, digests(x.double().float() + 1))
    s = summarize(res)
    assert s == {"rows_checked": 4, "mismatches": 4, "mismatched_rows": [0, 1, 2, 3],
                 "suspect_check": True}  # fmt: skip
    with pytest.raises(ValueError, match="int64"):
        verify_rows(x, torch.zeros(3, dtype=torch.int64))


def random_field(gen: torch.Generator, rows: int) -> torch.Tensor:
    dtype = DTYPES[int(torch.randint(len(DTYPES), (1,), generator=gen))]
    ndim = int(torch.randint(0, 3, (1,), generator=gen))
    shape = tuple(int(d) for d in torch.randint(1, 9, (ndim,), generator=gen))
    return make(dtype, (rows, *shape), gen)


def flip_rows(field: torch.Tensor) -> torch.Tensor:
    """Rows in reverse order (float8 has no flip kernel on CPU: flip its bytes)."""
    if field.dtype in FLOAT8:
        return field.view(torch.uint8).flip(0).view(field.dtype)
    return field.flip(0)


def test_soak_no_false_alarms() -> None:
    """500 rows over random dtypes/shapes: shards, reversed order, subsets, jagged trips."""
    gen = torch.Generator().manual_seed(5)
    rows_seen = 0
    while rows_seen < 500:
        n = int(torch.randint(1, 60, (1,), generator=gen))
        fields = {f"f{i}": random_field(gen, n) for i in range(3)}
        full = {k: digests(v) for k, v in fields.items()}
        for name, field in fields.items():
            d = full[name]
            # ground truth per row, digested alone
            assert d.tolist() == [single(r) for r in field]
            # every shard grouping: random cut points
            cuts = sorted(set(torch.randint(0, n + 1, (3,), generator=gen).tolist()) | {0, n})
            shards = [digests(field[a:b]) for a, b in itertools.pairwise(cuts)]
            assert torch.equal(torch.cat(shards), d)
            # reversed key order: digests follow their rows
            assert torch.equal(digests(flip_rows(field)), d.flip(0))
            # dense -> jagged with equal lengths (rows of rank >= 1)
            if field.dim() >= 2:
                assert torch.equal(digests(jagged(list(field))), d)
        # field subsets: digesting fewer fields changes nothing for the others
        subset = list(fields)[1:]
        assert all(torch.equal(digests(fields[k]), full[k]) for k in subset)
        rows_seen += n


def test_jagged_varying_lengths_round_trip() -> None:
    gen = torch.Generator().manual_seed(6)
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.complex64, torch.bool):
        rows = [make(dtype, (int(k), 3), gen) for k in torch.randint(0, 12, (40,), generator=gen)]
        nt = jagged(rows)
        d = digests(nt)
        assert d.tolist() == [single(r) for r in rows]
        renested = jagged(list(nt.unbind()))
        assert torch.equal(digests(renested), d)
        # shards of the jagged batch
        assert torch.equal(torch.cat([digests(jagged(rows[:17])), digests(jagged(rows[17:]))]), d)


def test_narrowed_jagged_uses_row_windows() -> None:
    base = torch.randn(5, 9)
    starts = torch.tensor([0, 2, 1, 0, 3])
    lens = torch.tensor([3, 4, 2, 9, 1])
    nt = torch.nested.narrow(base, 1, starts, lens, layout=torch.jagged)
    truth = [single(base[i, s : s + n]) for i, (s, n) in enumerate(zip(starts, lens, strict=True))]
    assert digests(nt).tolist() == truth


_CHILD = textwrap.dedent(
    """
    import sys, torch
    from syncless.dataplane.integrity import row_digests
    gen = torch.Generator().manual_seed(7)
    dense = torch.randn(33, 17, generator=gen).to(torch.bfloat16)
    ints = torch.randint(-1000, 1000, (33, 5, 2), generator=gen, dtype=torch.int64)
    rows = [torch.randn(int(k), generator=gen) for k in torch.randint(0, 20, (33,), generator=gen)]
    nt = torch.nested.nested_tensor(rows, layout=torch.jagged)
    out = [row_digests(t).tolist() for t in (dense, ints, nt)]
    print(repr(out))
    """
)


def test_digests_agree_across_processes() -> None:
    child = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True, timeout=60
    )
    gen = torch.Generator().manual_seed(7)
    dense = torch.randn(33, 17, generator=gen).to(torch.bfloat16)
    ints = torch.randint(-1000, 1000, (33, 5, 2), generator=gen, dtype=torch.int64)
    rows = [torch.randn(int(k), generator=gen) for k in torch.randint(0, 20, (33,), generator=gen)]
    mine = [digests(t).tolist() for t in (dense, ints, jagged(rows))]
    assert eval(child.stdout) == mine


def test_crc32_baseline_matches_zlib_and_dtype_codes_fixed() -> None:
    import zlib

    x = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    salt = zlib.crc32(f"{DTYPE_CODES[torch.int32]}:(4,)".encode())
    want = [
        zlib.crc32(np.arange(4 * i, 4 * i + 4, dtype=np.int32).tobytes(), salt) for i in range(3)
    ]
    assert crc32_digests(x).tolist() == want
    assert crc32_digests(jagged(list(x))).tolist() == want
    # wire format: codes never move
    assert DTYPE_CODES[torch.float32] == 9 and DTYPE_CODES[torch.bool] == 1
