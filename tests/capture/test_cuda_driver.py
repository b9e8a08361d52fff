"""The driver call that batches a boundary's two stream writes: its parameter array
must be exactly the C layout of two ``CUstreamBatchMemOpParams`` (no GPU needed: a
fake driver captures the bytes it is handed)."""

from __future__ import annotations

import ctypes
import struct
from types import SimpleNamespace

from syncless.cuda_driver import Driver


def _c_function(result: int = 0, calls: list | None = None):
    def fn(*args):
        if calls is not None:
            calls.append(args)
        return result

    return fn  # a Python function takes the argtypes attribute like a ctypes one


def _fake_lib(**calls):
    """A libcuda stand-in with the calls every Driver binds, plus ``calls``."""
    base = dict(
        cuEventRecord=_c_function(),
        cuEventElapsedTime=_c_function(),
        cuStreamWriteValue64_v2=_c_function(),
        cuMemHostGetDevicePointer_v2=_c_function(),
    )
    return SimpleNamespace(**{**base, **calls})


def _expected_write_64(address: int, value: int) -> bytes:
    """cuda.h: {CUstreamBatchMemOpType operation; CUdeviceptr address; union {u32 value;
    u64 value64}; unsigned flags; CUdeviceptr alias}, in a 48-byte union (pad[6])."""
    packed = struct.pack("<I4xQQI4xQ", 5, address, value, 0, 0)  # 5: WRITE_VALUE_64
    return packed + bytes(48 - len(packed))


def test_write_pair_hands_the_driver_two_write_value_64_params_in_order() -> None:
    seen: list[tuple[int, int, bytes, int]] = []

    def batch(stream, count, params, flags):
        seen.append((stream, count, ctypes.string_at(params, 96), flags))
        return 0

    lib = _fake_lib(cuStreamBatchMemOp_v2=batch)
    write = Driver(lib).write_pair_fn(0x7F00_0000_1000, 0x7F00_0000_2040)
    assert write is not None
    assert write(0xABC, 7, (1 << 64) - 1) == 0
    assert write(0xDEF, 8, 3 << 48 | 9) == 0
    assert [(s, n, f) for s, n, _, f in seen] == [(0xABC, 2, 0), (0xDEF, 2, 0)]
    for (_, _, raw, _), (a, b) in zip(seen, [(7, (1 << 64) - 1), (8, 3 << 48 | 9)], strict=True):
        assert raw == _expected_write_64(0x7F00_0000_1000, a) + _expected_write_64(
            0x7F00_0000_2040, b
        )


def test_write_pair_is_none_without_the_batch_call() -> None:
    assert Driver(_fake_lib()).write_pair_fn(16, 32) is None


def test_stream_capturing_reads_the_drivers_status_and_treats_an_error_as_capturing() -> None:
    status = {1: 0, 2: 1, 3: 2}  # none, active, invalidated (cuda.h)

    def is_capturing(stream, status_ref):
        if stream not in status:
            return 400  # CUDA_ERROR_INVALID_HANDLE
        status_ref._obj.value = status[stream]
        return 0

    capturing = Driver(_fake_lib(cuStreamIsCapturing=is_capturing)).stream_capturing_fn()
    assert [capturing(s) for s in (1, 2, 3, 4, 1)] == [False, True, True, True, False]


def test_memcpy_batch_hands_arrays_one_stream_ordered_attribute_and_the_stream_last() -> None:
    seen = []

    def record(dsts, srcs, sizes, count, attrs, first, num_attrs, *rest):
        a = attrs._obj
        attributes = (a.src_access_order, a.src_location.type, a.src_location.id, a.flags)
        arrays = (list(dsts), list(srcs), list(sizes), count, list(first), num_attrs)
        seen.append((*arrays, rest[-1], attributes, len(rest)))
        return 0

    for name, tail in (("cuMemcpyBatchAsync_v2", 1), ("cuMemcpyBatchAsync", 2)):
        seen.clear()
        batch = Driver(_fake_lib(**{name: record})).memcpy_batch_fn(3)
        assert batch is not None
        assert batch([100, 200], [1, 2], [5, 6], 0xABC) == 0
        # cuda.h: CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1, CU_MEM_LOCATION_TYPE_DEVICE = 1;
        # CUDA 12.8's ABI has a failIdx pointer before the stream, 13.0's _v2 none.
        assert seen == [([100, 200], [1, 2], [5, 6], 2, [0], 1, 0xABC, (1, 1, 3, 0), tail)]
    assert Driver(_fake_lib()).memcpy_batch_fn(0) is None
