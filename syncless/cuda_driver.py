"""The few CUDA driver calls syncless makes on the hot path, without releasing the GIL.

Why: a torch call such as ``Event.record()`` releases the GIL around its C++ body. On
a host-bound training step every release is a chance for another Python thread (a
drain worker, a writer, a data loader thread) to take the GIL, and the training thread
then waits for that thread's next release. These calls go through ``ctypes.PyDLL``,
which keeps the GIL for the ~2 us a driver call took on the H200's host. Measured
there (bench/RESULTS.md): the profiler's own host time fell from 5.96 to 3.88 ms per
step (profile_overhead, 4e46bc2 and a9d2e96), and the capture boundaries' from 15-22
to 6.97 ms per step (capture_windows, 3746a75 to 07d36f0, and a9d2e96).

Each call returns whether the driver accepted it; callers keep their torch path as the
fallback (no libcuda, a driver that refuses, CUDA graph capture). Handles are the raw
``CUevent`` / ``CUstream`` integers torch exposes (``Event.cuda_event``, the current
raw stream).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

_U64 = (1 << 64) - 1
# cuStreamBatchMemOp's CUstreamBatchMemOpParams: a 48-byte union, as six uint64 words;
# a 64-bit write is {operation: u32 (padded), address, value64, flags: u32, alias}.
_PARAM_WORDS = 6
_WRITE_VALUE_64 = 5  # CU_STREAM_MEM_OP_WRITE_VALUE_64
_CAPTURE_MODE_RELAXED = 2  # CU_STREAM_CAPTURE_MODE_RELAXED
_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes_v1`` (cuda.h, CUDA 12.8+)."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_location", _MemLocation),
        ("dst_location", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


class Driver:
    """``cuEventRecord``, ``cuEventElapsedTime``, ``cuMemcpyDtoDAsync``,
    ``cuStreamWriteValue64``, ``cuStreamBatchMemOp`` (where the driver has it),
    ``cuStreamIsCapturing`` and ``cuMemHostGetDevicePointer``."""

    def __init__(self, lib: Any, lib_releasing_gil: Any = None) -> None:
        self._lib = lib
        # The same library through ctypes.CDLL, whose calls release the GIL: for long
        # calls on a background thread (memcpy_batch_fn), not the training thread's.
        self._lib_releasing_gil = lib_releasing_gil or lib
        self._record = lib.cuEventRecord
        self._record.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        # CUDA 12.8 added _v2 (and 13 keeps only it in its headers); either has this ABI.
        elapsed = getattr(lib, "cuEventElapsedTime_v2", None) or lib.cuEventElapsedTime
        elapsed.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._elapsed = elapsed
        self._write = lib.cuStreamWriteValue64_v2
        self._write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint]
        self._host_ptr = lib.cuMemHostGetDevicePointer_v2
        self._host_ptr.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint]
        self._memcpy = getattr(lib, "cuMemcpyDtoDAsync_v2", None)
        if self._memcpy is not None:
            self._memcpy.argtypes = [
                ctypes.c_uint64,
                ctypes.c_uint64,
                ctypes.c_size_t,
                ctypes.c_void_p,
            ]
        batch = getattr(lib, "cuStreamBatchMemOp_v2", None) or getattr(
            lib, "cuStreamBatchMemOp", None
        )
        if batch is not None:
            batch.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_void_p, ctypes.c_uint]
        self._batch = batch
        self._is_capturing = getattr(lib, "cuStreamIsCapturing", None)
        if self._is_capturing is not None:
            self._is_capturing.argtypes = [ctypes.c_void_p, ctypes.c_void_p]

    def event_record(self, event: int, stream: int) -> bool:
        """Record ``event`` (a ``CUevent``) on ``stream`` (a ``CUstream``)."""
        return self._record(event, stream) == 0

    def record_fn(self) -> Any:
        """``cuEventRecord`` itself, ``(event, stream) -> CUresult`` (0 on success), for a
        caller that records on every span and binds it once."""
        return self._record

    def memcpy_fn(self) -> Any | None:
        """``cuMemcpyDtoDAsync`` itself, ``(dst, src, nbytes, stream) -> CUresult``, for
        the capture engine's copy into its ring (a torch ``copy_`` releases the GIL);
        None where the driver lacks it."""
        return self._memcpy

    def memcpy_batch_fn(
        self, device: int
    ) -> Callable[[list[int], list[int], list[int], int], int] | None:
        """``(dsts, srcs, sizes, stream) -> CUresult``: device-to-device copies of
        ``device`` in one ``cuMemcpyBatchAsync``, in stream order as a whole (in no
        order among themselves); None where the driver lacks it (before CUDA 12.8).
        One call for the drain's held copies of a look instead of one call each, which
        releases the GIL: it costs the host about as much as the copies one by one
        (264 us for 64 copies of 4 KiB against 4.94 us for one; bench/RESULTS.md,
        driver_calls at add772f), and the training thread runs meanwhile. The driver refuses the legacy
        default stream (``0``; CUDA_ERROR_INVALID_VALUE on
        the H200's 13.0 driver): see :meth:`create_blocking_stream`."""
        lib = self._lib_releasing_gil
        batch = getattr(lib, "cuMemcpyBatchAsync_v2", None)
        with_fail_index = batch is None  # CUDA 12.8's ABI: a failIdx before the stream
        if batch is None:
            batch = getattr(lib, "cuMemcpyBatchAsync", None)
        if batch is None:
            return None
        pointers = [ctypes.c_void_p] * 3
        tail = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        tail += [ctypes.c_void_p, ctypes.c_void_p] if with_fail_index else [ctypes.c_void_p]
        batch.argtypes = [*pointers, ctypes.c_size_t, *tail]
        location = _MemLocation(_LOCATION_DEVICE, device)
        attrs = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, location, location, 0)
        attrs_ref = ctypes.byref(attrs)
        first = (ctypes.c_size_t * 1)(0)
        fail_index = ctypes.c_size_t()
        fail_ref = ctypes.byref(fail_index)

        def copy_batch(dsts: list[int], srcs: list[int], sizes: list[int], stream: int) -> int:
            n = len(dsts)
            words = ctypes.c_uint64 * n
            args = (words(*dsts), words(*srcs), (ctypes.c_size_t * n)(*sizes), n, attrs_ref)
            if with_fail_index:
                return batch(*args, first, 1, fail_ref, stream)
            return batch(*args, first, 1, stream)

        return copy_batch

    def create_blocking_stream(self) -> int | None:
        """A new stream created without ``CU_STREAM_NON_BLOCKING`` (torch's are
        non-blocking): work on it is ordered after the legacy default stream's earlier
        work and before its later work, as if enqueued there. For calls the driver
        refuses on the legacy stream itself (``cuMemcpyBatchAsync``). None if refused.
        Never destroyed: one per copier, for the life of the process."""
        handle = ctypes.c_void_p()
        if self._lib.cuStreamCreate(ctypes.byref(handle), 0) != 0:
            return None
        return handle.value or None

    def stream_capturing_fn(self) -> Callable[[int], bool]:
        """``(stream) -> bool``: is ``stream`` being captured into a CUDA graph (or did
        the driver not say)? For a thread that enqueues work on another thread's stream:
        work enqueued during that thread's graph capture would become part of the graph
        and run again at every replay. Without the call (a driver before CUDA 10),
        always False."""
        is_capturing = self._is_capturing
        if is_capturing is None:
            return lambda stream: False
        status = ctypes.c_int()
        status_ref = ctypes.byref(status)

        def capturing(stream: int) -> bool:
            return is_capturing(stream, status_ref) != 0 or status.value != 0

        return capturing

    def relax_capture_mode(self) -> bool:
        """Put the calling thread in relaxed stream-capture mode
        (``cuThreadExchangeStreamCaptureMode``). Under a CUDA graph captured in global
        mode (``torch.cuda.graph``'s default), a call that might sync (an event query, a
        copy into pinned memory) from any thread in the default mode invalidates the
        capture; a background thread that never enqueues on the capturing stream can
        make them safely. Whether the driver took it."""
        return self.exchange_capture_mode(_CAPTURE_MODE_RELAXED) is not None

    def exchange_capture_mode(self, mode: int) -> int | None:
        """Set the calling thread's stream-capture mode; the mode it had, or None where
        the driver lacks the call or refused it."""
        fn = getattr(self._lib, "cuThreadExchangeStreamCaptureMode", None)
        if fn is None:
            return None
        value = ctypes.c_int(mode)
        return value.value if fn(ctypes.byref(value)) == 0 else None

    def write_fn(self) -> Any:
        """``cuStreamWriteValue64`` itself, ``(stream, address, value, flags) ->
        CUresult``, ``value`` already in ``[0, 2**64)``, for a caller that binds it once."""
        return self._write

    def write_pair_fn(self, first: int, second: int) -> Callable[[int, int, int], int] | None:
        """``(stream, a, b) -> CUresult``: write ``a`` at device address ``first`` and
        then ``b`` at ``second`` (both already in ``[0, 2**64)``) by one
        ``cuStreamBatchMemOp``, in that order on the stream; None without the call.

        Why: each driver call is a few microseconds of the host, and a caller that
        writes two words per event (the capture boundaries, 192 per step in the
        expert-parallel demo) pays one call instead of two. The parameter array is
        built once; a call sets the two values in place.
        """
        batch = self._batch
        if batch is None:
            return None
        params = (ctypes.c_uint64 * (2 * _PARAM_WORDS))()
        for base, address in ((0, first), (_PARAM_WORDS, second)):
            params[base] = _WRITE_VALUE_64  # the u32 operation, little-endian
            params[base + 1] = address
        first_value, second_value = 2, _PARAM_WORDS + 2

        def write_pair(stream: int, a: int, b: int) -> int:
            params[first_value] = a
            params[second_value] = b
            return batch(stream, 2, params, 0)

        return write_pair

    def elapsed_into(self, out_ref: Any, start: int, end: int) -> bool:
        """``cuEventElapsedTime`` into a caller's ``ctypes.byref(c_float)``, no
        allocation per call; whether the driver gave a time."""
        return self._elapsed(out_ref, start, end) == 0

    def stream_write_u64(self, stream: int, address: int, value: int) -> bool:
        """Write ``value`` (any int; its low 64 bits) at device ``address`` when the
        stream reaches this point."""
        return self._write(stream, address, value & _U64, 0) == 0

    def host_device_pointer(self, host: torch.Tensor) -> int | None:
        """The device address of pinned host memory (``None`` if it is not mapped)."""
        out = ctypes.c_uint64()
        ok = self._host_ptr(ctypes.byref(out), ctypes.c_void_p(host.data_ptr()), 0) == 0
        return out.value if ok else None


@contextlib.contextmanager
def relaxed_capture() -> Iterator[bool]:
    """This thread in relaxed stream-capture mode for the block (whether it could be
    set). For cold-path work during a capture (a one-time upload on another stream):
    in the global and thread-local modes an event query or a stream sync from the
    capturing thread invalidates the capture, in the relaxed mode it is allowed."""
    drv = driver()
    before = drv.exchange_capture_mode(_CAPTURE_MODE_RELAXED) if drv is not None else None
    try:
        yield before is not None
    finally:
        if drv is not None and before is not None:
            drv.exchange_capture_mode(before)


@functools.cache
def driver() -> Driver | None:
    """The driver, or ``None`` where libcuda or one of the calls is missing."""
    if not torch.cuda.is_available():
        return None
    try:
        return Driver(ctypes.PyDLL("libcuda.so.1"), ctypes.CDLL("libcuda.so.1"))
    except (OSError, AttributeError):
        return None


def raw_stream_getters() -> tuple[Callable[[int], int], Callable[[], int]]:
    """``(stream_of, current_device)``: torch's C getters for a device's current
    ``CUstream`` (an int) and for the current device, so that a hot path calls
    ``stream_of(current_device())`` without a Python frame of its own; Python
    equivalents where a torch build lacks them (they are not a public API)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    get_device = getattr(torch._C, "_cuda_getDevice", None)
    if raw is None or get_device is None:
        return current_raw_stream, torch.cuda.current_device
    return raw, get_device


def current_raw_stream_fn(device: int | None = None) -> Callable[[], int]:
    """A no-argument function returning the current ``CUstream`` of ``device`` (default:
    the current device), bound to torch's C getters (``current_raw_stream()`` goes
    through ``torch.cuda.current_device()``'s Python)."""
    stream_of, current_device = raw_stream_getters()
    if device is not None:
        return lambda: stream_of(device)
    return lambda: stream_of(current_device())


#: ``torch.cuda.is_current_stream_capturing`` without its Python frame, for hot paths
#: that check it per call. A CPU build's C function raises: call it for CUDA work only.
stream_capturing: Callable[[], bool] = getattr(
    torch._C, "_cuda_isCurrentStreamCapturing", torch.cuda.is_current_stream_capturing
)


def current_raw_stream(device: int | None = None) -> int:
    """The current ``CUstream`` of ``device`` (default: the current device), as an int."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:  # not a public API: the slow way if a torch build lacks it
        return torch.cuda.current_stream(device).cuda_stream
    return raw(torch.cuda.current_device() if device is None else device)
