"""Byte accounting: tensor_nbytes against contiguous()/cat recounts, msgpack_size against packb."""

from __future__ import annotations

import random

import msgpack
import pytest
import torch

from syncless.dataplane.bytes import msgpack_size, payload_nbytes, tensor_nbytes
from syncless.guard import SyncError, allow_sync, no_sync

# ---------------------------------------------------------------------------- tensors


def _dense_cases() -> list[tuple[str, torch.Tensor]]:
    base = torch.randn(6, 10)
    cases = [
        ("dense", base),
        ("row_slice", base[1:4]),
        ("col_slice", base[:, 2:7]),
        ("step_slice", base[::2, ::3]),
        ("transposed", base.t()),
        ("permuted_3d", torch.randn(3, 4, 5).permute(2, 0, 1)),
        ("expanded_stride0", torch.randn(1, 64).expand(1000, 64)),
        ("expanded_scalar", torch.tensor(3.0).expand(7, 9)),
        ("diagonal", torch.randn(5, 5).diagonal()),
        ("zero_dim", torch.tensor(1.5)),
        ("empty", torch.empty(0, 8)),
        ("bf16", torch.randn(4, 3, dtype=torch.bfloat16).t()),
        ("bool", torch.rand(7, 3) > 0.5),
        ("int64", torch.arange(30).reshape(5, 6)[:, ::2]),
        ("float8_e4m3fn", torch.randn(8, 4).to(torch.float8_e4m3fn)),
        ("complex64", torch.randn(3, 3, dtype=torch.complex64)),
    ]
    return cases


@pytest.mark.parametrize(("name", "t"), _dense_cases(), ids=[n for n, _ in _dense_cases()])
def test_dense_matches_contiguous_nbytes(name: str, t: torch.Tensor) -> None:
    expected = t.contiguous().nbytes  # ground truth: the materialised copy
    with no_sync():
        got = tensor_nbytes(t)
    assert got == expected


def test_expanded_counts_materialised_size() -> None:
    t = torch.zeros(1, 64, dtype=torch.float32).expand(1000, 64)
    assert tensor_nbytes(t) == 1000 * 64 * 4


def test_parameter_subclass() -> None:
    p = torch.nn.Parameter(torch.randn(3, 5))
    assert tensor_nbytes(p) == 3 * 5 * 4


def test_sparse_is_unknown() -> None:
    assert tensor_nbytes(torch.eye(4).to_sparse()) is None


def _cat_nbytes(nt: torch.Tensor) -> int:
    """Independent recount: the bytes of the rows the nested tensor yields, concatenated."""
    return torch.cat([r.reshape(-1) for r in nt.unbind()]).nbytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("row_shape", [(), (4,), (3, 2)])
def test_jagged_matches_cat_of_rows(dtype: torch.dtype, row_shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 0, 7, 1, 5]
    rows = [torch.randn(n, *row_shape, generator=gen).to(dtype) for n in lengths]
    nt = torch.nested.nested_tensor(rows, layout=torch.jagged)
    expected = _cat_nbytes(nt)
    assert expected == sum(lengths) * max(1, torch.Size(row_shape).numel()) * nt.element_size()
    with no_sync():  # ordinary jagged: metadata only, nothing that would sync on a GPU
        got = tensor_nbytes(nt)
    assert got == expected


def test_jagged_from_jagged_and_transposed() -> None:
    values = torch.randn(12, 5)
    nt = torch.nested.nested_tensor_from_jagged(values, offsets=torch.tensor([0, 4, 9, 12]))
    assert tensor_nbytes(nt) == _cat_nbytes(nt) == 12 * 5 * 4
    nt2 = torch.nested.nested_tensor(
        [torch.randn(3, 4, 2), torch.randn(5, 4, 2)], layout=torch.jagged
    ).transpose(1, 2)  # ragged dim moves: _values is transposed too
    assert nt2._ragged_idx == 2
    assert tensor_nbytes(nt2) == _cat_nbytes(nt2) == 8 * 4 * 2 * 4


def test_jagged_narrowed_counts_live_rows_only() -> None:
    base = torch.randn(3, 10, 4)
    starts = torch.tensor([0, 2, 5])
    lengths = torch.tensor([2, 6, 1])
    nt = torch.nested.narrow(base, 1, starts, lengths, layout=torch.jagged)
    assert nt._values.shape[0] > int(nt._offsets[-1])  # a real holey view
    expected = _cat_nbytes(nt)
    assert expected == 9 * 4 * 4
    assert tensor_nbytes(nt) == expected  # CPU: the lengths are read
    # The read is a device read where the tensor lives on a device: under the guard
    # (which treats CPU tensors as device tensors here) it is flagged, and allowed
    # only when asked for.
    with no_sync(cpu_as_device=True):
        with pytest.raises(SyncError):
            tensor_nbytes(nt)
        with allow_sync("test: narrowed NJT byte count"):
            assert tensor_nbytes(nt, allow_device_read=True) == expected


def test_jagged_never_calls_public_nbytes(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.nested._internal.nested_tensor import NestedTensor

    def boom(*_a: object, **_k: object) -> None:
        raise AssertionError("slow public API used")

    nt = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged)
    monkeypatch.setattr(NestedTensor, "numel", boom, raising=False)
    monkeypatch.setattr(NestedTensor, "nbytes", property(boom), raising=False)
    assert tensor_nbytes(nt) == 6 * 3 * 4


def test_payload_nbytes_dispatch() -> None:
    a, b = torch.randn(3, 4), torch.randn(5, dtype=torch.float64)
    assert payload_nbytes(a) == 48
    assert payload_nbytes([a, b]) == 48 + 40
    assert payload_nbytes((a, b.t())) == 88
    assert payload_nbytes({"k": [1, 2.5, "x"]}) == len(msgpack.packb({"k": [1, 2.5, "x"]}))
    assert payload_nbytes([a, "not a tensor"]) is None
    assert payload_nbytes([a, torch.eye(2).to_sparse()]) is None
    assert payload_nbytes([]) == 1
    assert payload_nbytes({1, 2}) is None


# ---------------------------------------------------------------------------- msgpack

_INT_EDGES = [
    0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1,
    -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63),
]  # fmt: skip
_LEN_EDGES = [0, 1, 15, 16, 31, 32, 255, 256, 65535, 65536]


def _boundary_values() -> list[object]:
    vals: list[object] = [None, True, False, 0.0, -1.5, float("inf"), float("nan"), 1e300]
    vals += _INT_EDGES
    for n in _LEN_EDGES:
        vals += ["a" * n, b"b" * n, bytearray(n), memoryview(b"m" * n)]
        vals += [[0] * n, tuple([None] * n), {i: i for i in range(n)}]
    vals += ["é" * 16, "€" * 11, "😀" * 8, "ß" * 128]  # multi-byte: header by utf-8 length
    vals += [msgpack.ExtType(5, b"x" * n) for n in (0, 1, 2, 3, 4, 8, 16, 17, 255, 256, 65536)]
    vals += [[[[[]]]], {"a": {"b": [1, {"c": ()}]}}, {(1, 2): "tuple key"}]
    return vals


@pytest.mark.parametrize("value", _boundary_values(), ids=lambda v: type(v).__name__)
def test_msgpack_boundaries(value: object) -> None:
    # The 65536-entry dict is 131073 objects: past the default walk bound.
    assert msgpack_size(value, max_items=10**6) == len(msgpack.packb(value))


def _random_payload(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(10 if depth < 4 else 7)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice(_INT_EDGES) + rng.choice([0, 0, 1, -1]) * (rng.random() < 0.3)
    if kind == 2:
        return rng.randint(-(2**40), 2**40) >> rng.randrange(41)
    if kind == 3:
        return rng.uniform(-1e6, 1e6)
    if kind == 4:
        alphabet = "ab€😀é"
        return "".join(rng.choice(alphabet) for _ in range(rng.choice([0, 5, 31, 32, 70, 300])))
    if kind == 5:
        return bytes(rng.randrange(256) for _ in range(rng.choice([0, 3, 255, 256, 300])))
    if kind == 6:
        return rng.choice(["key", "k" * 40, 7])
    n = rng.choice([0, 1, 3, 15, 16, 20])
    if kind == 7:
        return [_random_payload(rng, depth + 1) for _ in range(n)]
    if kind == 8:
        return tuple(_random_payload(rng, depth + 1) for _ in range(n))
    return {
        rng.choice([f"k{i}", i, -i, float(i), b"%d" % i]): _random_payload(rng, depth + 1)
        for i in range(n)
    }


def test_msgpack_random_payloads_byte_for_byte() -> None:
    rng = random.Random(1234)
    for _ in range(400):
        v = _random_payload(rng)
        try:
            expected = len(msgpack.packb(v))
        except (OverflowError, ValueError, TypeError):
            expected = None  # e.g. an int edge pushed past 2**64 - 1
        assert msgpack_size(v) == expected, v


class _Obj:
    pass


@pytest.mark.parametrize(
    "value",
    [
        {1, 2},
        frozenset(),
        _Obj(),
        [1, 2, {3}],
        {"a": object()},
        2**64,
        -(2**63) - 1,
        "\ud800",  # lone surrogate: packb raises
        torch.zeros(2),
        complex(1, 2),
    ],
    ids=lambda v: type(v).__name__,
)
def test_msgpack_unsupported_is_none(value: object) -> None:
    with pytest.raises((TypeError, OverflowError, ValueError, UnicodeEncodeError)):
        msgpack.packb(value)
    assert msgpack_size(value) is None


def test_msgpack_walk_is_bounded() -> None:
    big = list(range(1000))
    assert msgpack_size(big) == len(msgpack.packb(big))
    assert msgpack_size(big, max_items=1000) is None  # 1001 objects: the list + items
    assert msgpack_size(big, max_items=1001) == len(msgpack.packb(big))
    nested = [[i, str(i)] for i in range(100)]  # 1 + 100 + 200 objects
    assert msgpack_size(nested, max_items=300) is None
    assert msgpack_size(nested, max_items=301) == len(msgpack.packb(nested))
    d = {i: i for i in range(50)}  # 1 + 100 objects
    assert msgpack_size(d, max_items=100) is None
    assert msgpack_size(d, max_items=101) == len(msgpack.packb(d))
    cyc: list[object] = []
    cyc.append(cyc)
    assert msgpack_size(cyc) is None  # a cycle ends at the bound, as packb ends in an error


def test_msgpack_depth_limit_matches_packb() -> None:
    def wrap(n: int) -> object:
        x: object = 1
        for _ in range(n):
            x = [x]
        return x

    ok, too_deep = wrap(1024), wrap(1025)
    assert msgpack_size(ok) == len(msgpack.packb(ok))
    with pytest.raises(ValueError):
        msgpack.packb(too_deep)
    assert msgpack_size(too_deep) is None
