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

    lib = SimpleNamespace(
        cuEventRecord=_c_function(),
        cuEventElapsedTime=_c_function(),
        cuStreamWriteValue64_v2=_c_function(),
        cuMemHostGetDevicePointer_v2=_c_function(),
        cuStreamBatchMemOp_v2=batch,
    )
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
    lib = SimpleNamespace(
        cuEventRecord=_c_function(),
        cuEventElapsedTime=_c_function(),
        cuStreamWriteValue64_v2=_c_function(),
        cuMemHostGetDevicePointer_v2=_c_function(),
    )
    assert Driver(lib).write_pair_fn(16, 32) is None


def _copy16_lib(launches: list, load_result: int = 0) -> SimpleNamespace:
    def load(module_ref, ptx):
        assert b".entry syncless_copy16" in ctypes.string_at(ptx)
        return load_result

    def get_function(function_ref, module, name):
        ctypes.cast(function_ref, ctypes.POINTER(ctypes.c_void_p))[0] = 0x5EED
        return 0

    def launch(fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        words = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        values = [ctypes.cast(words[i], ctypes.POINTER(ctypes.c_uint64))[0] for i in range(3)]
        launches.append((fn, (gx, gy, gz), (bx, by, bz), shared, stream, values, extra))
        return 0

    return SimpleNamespace(
        cuEventRecord=_c_function(),
        cuEventElapsedTime=_c_function(),
        cuStreamWriteValue64_v2=_c_function(),
        cuMemHostGetDevicePointer_v2=_c_function(),
        cuModuleLoadData=load,
        cuModuleGetFunction=get_function,
        cuLaunchKernel=launch,
    )


def test_copy16_launches_one_grid_over_the_16_byte_words() -> None:
    launches: list = []
    copy16 = Driver(_copy16_lib(launches)).copy16_fn()
    assert copy16 is not None
    assert copy16(0x7000, 0x9000, 4096, 0xABC) == 0  # 256 words: one block of 256
    assert copy16(0x7000, 0x9000, 16, 0) == 0  # one word: one block
    assert copy16(0x1_0000_0000, 0x2_0000_0000, 64 << 20, 1) == 0  # 4 Mi words: capped
    assert launches == [
        (0x5EED, (1, 1, 1), (256, 1, 1), 0, 0xABC, [0x7000, 0x9000, 256], None),
        (0x5EED, (1, 1, 1), (256, 1, 1), 0, 0, [0x7000, 0x9000, 1], None),
        (0x5EED, (1024, 1, 1), (256, 1, 1), 0, 1, [0x1_0000_0000, 0x2_0000_0000, 4 << 20], None),
    ]


def test_copy16_is_none_when_the_module_does_not_load() -> None:
    assert Driver(_copy16_lib([], load_result=218)).copy16_fn() is None  # a PTX JIT error
