"""Tests for syncless.dataplane.integrity: order-aware per-row digests.

Ground truth is independent of the batch digest: each row's expected digest is the digest
of the unmodified row computed on its own (a one-row batch), and "caught" means the
modified row's digest differs from it. The scheme itself is pinned by a pure-Python
reference of the documented digest (:func:`reference_digest`, Python integers, one row at
a time) and by golden values. Every digest computation runs under
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

from syncless.dataplane import integrity
from syncless.dataplane.integrity import (
    DTYPE_CODES,
    crc32_digests,
    row_digests,
    summarize,
    verify_rows,
    xor_fold_digests,
)
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


# -- the scheme, independently: the module docstring's digest in Python integers ----------

_MASK64 = (1 << 64) - 1
# The wire format's constants, restated rather than imported: changing the module's
# changes every digest and must fail here.
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
_K_WORD = 0xD6E8FEB86659FD93
_C_WEIGHT = 0x243F6A8885A308D3
_C_SALT = 0x13198A2E03707344


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def _row_chunks(row: torch.Tensor) -> list[int]:
    """The row's bytes (row-major elements, each as stored; complex as real/imag pairs)
    cut into 8-byte chunks, the last one zero-padded, read as little-endian integers."""
    if row.is_complex():
        row = torch.view_as_real(row)
    raw = bytes(row.reshape(-1).contiguous().view(torch.uint8).tolist())
    raw += bytes(-len(raw) % 8)
    return [int.from_bytes(raw[i : i + 8], "little") for i in range(0, len(raw), 8)]


def reference_digest(row: torch.Tensor) -> int:
    """One row's digest exactly as the module docstring describes it."""
    total = 0
    for k, chunk in enumerate(_row_chunks(row)):
        weight = _mix64((k * _GOLDEN + _C_WEIGHT) & _MASK64) | 1
        t = (chunk * weight) & _MASK64
        t = ((t ^ (t >> 29)) * _K_WORD) & _MASK64
        total = (total + t) & _MASK64
    salt = _mix64(((DTYPE_CODES[row.dtype] << 8) + row.dim()) ^ _C_SALT)
    for dim in row.shape:
        salt = _mix64((salt + dim) & _MASK64)
    digest = _mix64(total ^ salt)
    return digest - (1 << 64) if digest >> 63 else digest


@pytest.mark.parametrize("block", [1 << 17, 3], ids=["one-block", "block3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dense_digests_match_reference(
    dtype: torch.dtype, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows read in place or padded, in blocks of rows or (block3) of chunks."""
    monkeypatch.setattr(integrity, "_BLOCK_CHUNKS_CPU", block)
    monkeypatch.setattr(integrity, "_TABLE_MAX_POSITIONS", 0 if block == 3 else 1 << 24)
    gen = torch.Generator().manual_seed(8)
    field = make(dtype, (4, 5, 3), gen)
    assert digests(field).tolist() == [reference_digest(r) for r in field]
    scalars = field[:, 0, 0]  # rows of rank 0
    assert digests(scalars).tolist() == [reference_digest(r) for r in scalars]


def test_golden_digests() -> None:
    """Pinned digests: the wire format. Since the 8-byte chunks, rows of elements (or
    complex parts) narrower than 8 bytes digest differently from earlier versions; rows of
    8-byte ones (one per chunk, as one per word before) keep their digests: the int64
    values were computed at 8eb0ca3."""
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert digests(x).tolist() == [
        -5580014126068368268,
        6144315645623853965,
        8398791162514927483,
    ]
    b = torch.tensor([[1, 0, 1], [0, 1, 1]], dtype=torch.bool)
    assert digests(b).tolist() == [-5569661380946263775, 240638550390041935]
    rows = [torch.arange(n, dtype=torch.int16) for n in (0, 1, 5)]
    assert digests(jagged(rows)).tolist() == [
        -4991256325080851329,
        5172806144003256646,
        -3628672336980607609,
    ]
    longs = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    assert digests(longs).tolist() == [6887578158424734227, -8953292675023219317]


def jagged_layouts(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same rows as jagged tensors that take each code path."""
    nt = jagged(rows)
    values, offsets = nt.values(), nt.offsets()
    spare = torch.cat([values, values[:2]])  # values past the last row
    return {
        "from list (cached lengths)": nt,
        "no cached lengths": torch.nested.nested_tensor_from_jagged(values, offsets),
        "values past the last row": torch.nested.nested_tensor_from_jagged(
            spare, offsets, min_seqlen=nt._maybe_min_seqlen, max_seqlen=nt._maybe_max_seqlen
        ),
    }


@pytest.mark.parametrize("block", [1 << 17, 7, 1], ids=["one-block", "block7", "block1"])
@pytest.mark.parametrize("table", [True, False], ids=["table", "computed"])
def test_jagged_paths_match_reference(
    block: int, table: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uniform rows (the dense layout), varied rows (cumulative-sum positions), rows
    without cached lengths, spare values: every path gives the reference digest, with
    row and block boundaries anywhere and weights gathered or computed."""
    monkeypatch.setattr(integrity, "_BLOCK_CHUNKS_CPU", block)
    monkeypatch.setattr(integrity, "_WEIGHT_TABLES", {})
    if not table:
        monkeypatch.setattr(integrity, "_TABLE_MAX_POSITIONS", 0)
    gen = torch.Generator().manual_seed(9)
    cases = {
        "uniform": [make(torch.float32, (6,), gen) for _ in range(4)],
        "varied": [make(torch.int16, (n,), gen) for n in (3, 0, 9, 1, 4)],
        "varied inner": [make(torch.bfloat16, (n, 2, 3), gen) for n in (2, 5, 0, 3)],
        "uniform inner": [make(torch.complex64, (3, 2), gen) for _ in range(3)],
        "bytes": [make(torch.bool, (n,), gen) for n in (5, 9, 0, 17, 1, 8)],
        "3-byte values": [make(torch.uint8, (n, 3), gen) for n in (2, 5, 1, 6)],
        "6-byte values": [make(torch.int16, (n, 3), gen) for n in (3, 1, 4)],
        "8-byte values": [make(torch.float64, (n,), gen) for n in (2, 0, 3)],
    }
    for name, rows in cases.items():
        want = [reference_digest(r) for r in rows]
        for layout, nt in jagged_layouts(rows).items():
            assert digests(nt).tolist() == want, (name, layout)
    base = make(torch.int32, (5, 9), gen)
    starts, lens = [0, 2, 1, 0, 3], [3, 4, 2, 9, 1]
    holes = torch.nested.narrow(
        base, 1, torch.tensor(starts), torch.tensor(lens), layout=torch.jagged
    )
    bounds = enumerate(zip(starts, lens, strict=True))
    want = [reference_digest(base[i, s : s + n]) for i, (s, n) in bounds]
    assert digests(holes).tolist() == want


def test_weight_table_growth_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(integrity, "_WEIGHT_TABLES", {})
    gen = torch.Generator().manual_seed(10)
    short, long = make(torch.float32, (3, 5), gen), make(torch.float32, (2, 9000), gen)
    first = digests(short)
    digests(long)  # grows the cached table past 4096 positions
    assert torch.equal(digests(short), first)
    assert digests(long[:, :40]).tolist() == [reference_digest(r) for r in long[:, :40]]


def test_empty_fields_and_rows() -> None:
    """No rows, rows of no elements, jagged rows that are all empty (every layout)."""
    assert digests(torch.zeros(0, 4)).shape == (0,)
    assert digests(torch.zeros(0)).shape == (0,)
    for inner in ((), (3,)):
        rows = [torch.zeros(0, *inner), torch.zeros(0, *inner)]
        want = [reference_digest(r) for r in rows]
        assert digests(torch.zeros(2, 0, *inner)).tolist() == want
        for layout, nt in jagged_layouts(rows).items():
            assert digests(nt).tolist() == want, layout


def test_dense_rows_off_an_8_byte_boundary() -> None:
    """Rows read in place need 8-byte alignment; a field that starts mid-chunk is copied."""
    base = make(torch.int32, (41,), torch.Generator().manual_seed(11))
    field = base[1:].view(5, 8)  # rows of 32 bytes starting 4 bytes past an 8-byte boundary
    assert field.data_ptr() % 8 == 4
    assert digests(field).tolist() == [reference_digest(r) for r in field]


def randint(high: int, gen: torch.Generator, low: int = 0) -> int:
    return int(torch.randint(low, high, (1,), generator=gen))


@pytest.mark.parametrize("block", [1 << 17, 3], ids=["one-block", "block3"])
def test_random_jagged_layouts_match_reference(block: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Random dtypes, inner shapes, lengths and starts (holes included): every layout
    against the reference."""
    monkeypatch.setattr(integrity, "_BLOCK_CHUNKS_CPU", block)
    gen = torch.Generator().manual_seed(12)
    for _ in range(25):
        dtype = DTYPES[randint(len(DTYPES), gen)]
        inner = (randint(4, gen, low=1),) * randint(2, gen)
        lens = [randint(12, gen) for _ in range(randint(7, gen, low=1))]
        rows = [make(dtype, (n, *inner), gen) for n in lens]
        want = [reference_digest(r) for r in rows]
        for layout, nt in jagged_layouts(rows).items():
            assert digests(nt).tolist() == want, (dtype, inner, lens, layout)
        # narrow() builds a wrong tensor when a length is 0 (torch 2.13): lengths >= 1
        lens = [max(n, 1) for n in lens]
        base = make(dtype, (len(lens), 12, *inner), gen)
        starts = [randint(13 - n, gen) for n in lens]
        holes = torch.nested.narrow(
            base, 1, torch.tensor(starts), torch.tensor(lens), layout=torch.jagged
        )
        bounds = enumerate(zip(starts, lens, strict=True))
        want = [reference_digest(base[i, s : s + n]) for i, (s, n) in bounds]
        assert digests(holes).tolist() == want, (dtype, inner, lens, starts)
