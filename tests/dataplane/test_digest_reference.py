"""The digest scheme, independently: row_digests against a pure-Python version of the
scheme in syncless/dataplane/digest_scheme.py (:func:`reference_digest`, Python integers,
one row at a time) and golden values, on every dense and jagged path of
syncless/dataplane/digest_sums.py. Every digest computation runs under
``no_sync(cpu_as_device=True)``.
"""

from __future__ import annotations

import pytest
import torch
from integrity_fields import DTYPES, digests, jagged, make

from syncless.dataplane import digest_sums
from syncless.dataplane.digest_scheme import DTYPE_CODES

_MASK64 = (1 << 64) - 1
# The wire format's constants, restated rather than imported: changing digest_scheme's
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
    """One row's digest exactly as digest_scheme's module docstring describes it."""
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
    monkeypatch.setattr(digest_sums, "_BLOCK_CHUNKS_CPU", block)
    monkeypatch.setattr(digest_sums, "_TABLE_MAX_POSITIONS", 0 if block == 3 else 1 << 24)
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
    monkeypatch.setattr(digest_sums, "_BLOCK_CHUNKS_CPU", block)
    monkeypatch.setattr(digest_sums, "_WEIGHT_TABLES", {})
    if not table:
        monkeypatch.setattr(digest_sums, "_TABLE_MAX_POSITIONS", 0)
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
    monkeypatch.setattr(digest_sums, "_WEIGHT_TABLES", {})
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
    monkeypatch.setattr(digest_sums, "_BLOCK_CHUNKS_CPU", block)
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
