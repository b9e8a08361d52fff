"""Byte accounting for transfer payloads, computed from metadata instead of serialising.

A key-value transfer wrapper wants "how many bytes did this put/get move" on the hot
path. Serialising or copying to find out would cost more than the transfer bookkeeping
itself, so every count here is derived from metadata:

``tensor_nbytes(t)``
    The bytes ``t.contiguous()`` would occupy: ``numel * element_size`` for dense tensors
    and every kind of view (sliced, transposed, stride-0 ``expand``-ed: an expanded
    ``[1000, 64]`` view of a ``[1, 64]`` tensor counts 1000*64 elements, as ``contiguous()``
    would materialise them). No copy, no device read.

    Jagged nested tensors (``torch.nested``, ``layout=torch.jagged``) count the packed
    values the nested tensor describes, read from ``nt._values`` / ``nt._lengths``. Their
    public ``.nbytes`` / ``.numel()`` are never called: they dispatch through
    ``__torch_function__`` and cost orders of magnitude more than the private attributes.

    * Ordinary jagged tensor (``nt._lengths is None``: built from a list, by
      ``nested_tensor_from_jagged(values, offsets)``, or returned by a transfer client):
      torch's own invariant (``unbind`` splits ``_values`` by ``offsets.diff()`` and
      requires the sizes to cover it exactly) is that ``_values`` holds exactly the
      packed rows, so the count is ``_values.numel() * element_size``: metadata only,
      **no device read on any device**.
    * Narrowed ("holey") jagged tensor (``nt._lengths is not None``, e.g. from
      ``torch.nested.narrow``): ``_values`` is a window over a padded buffer and only
      ``sum(lengths)`` rows are live. That sum lives in device memory and no metadata
      carries it (``_min_seqlen`` / ``_max_seqlen`` are bounds only). On a CPU tensor it
      is read (no sync exists there). On any other device it is read only when the caller
      passes ``allow_device_read=True``; otherwise ``tensor_nbytes`` returns ``None``
      ("unknown") rather than stall the stream or report the padded size as if it moved.
      Callers count those abstentions.

    Sparse and other non-strided layouts return ``None``: their wire size depends on
    the encoding.

``msgpack_size(obj)``
    Exactly ``len(msgpack.packb(obj))`` (msgpack-python defaults: ``use_bin_type=True``,
    floats as float64) by a bounded iterative walk that packs nothing: ``None``, ``bool``,
    ``int`` (every width), ``float``, ``str`` (utf-8 length), ``bytes`` / ``bytearray`` /
    ``memoryview`` (bin), ``list`` / ``tuple`` (array), ``dict`` (map) and
    ``msgpack.ExtType``. Returns ``None`` wherever ``packb`` would raise (unsupported type,
    int out of the 64-bit range, lone surrogate, object over 2**32-1 bytes or items,
    nesting deeper than packb's recursion limit) and when the walk would visit more than
    ``max_items`` objects, so its cost is bounded (and cycles end).

    Cost model: the walk is Python, so per item it is slower than packb's C encoder;
    what it buys is a cost set by the item count alone (a large ``bytes`` or ``str`` costs
    the same as a small one, where packb copies every byte) and no output buffer. When
    the caller is about to pack the object anyway, ``len`` of that packed buffer is the
    cheaper count (``bench/dataplane/histogram.py`` measures both).

``payload_nbytes(value)``
    Dispatch: a tensor, a list/tuple whose items are all tensors (summed), or any other
    Python object (``msgpack_size``). ``None`` means unknown.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch
from torch.nested._internal.nested_tensor import NestedTensor

from syncless.hot_path import hot_path

__all__ = ["msgpack_size", "payload_nbytes", "tensor_nbytes"]

# The deepest nesting msgpack-python's packb accepts: an object 1024 containers below the
# top level packs, one at 1025 raises "recursion limit exceeded" (measured, msgpack 1.1).
_MSGPACK_MAX_DEPTH = 1024
_U32 = 0xFFFFFFFF


@hot_path
def tensor_nbytes(t: torch.Tensor, *, allow_device_read: bool = False) -> int | None:
    """Bytes ``t.contiguous()`` would occupy, without copying (see the module docstring).

    Returns ``None`` for layouts whose wire size is encoding-dependent (sparse, mkldnn)
    and for a narrowed jagged nested tensor on a non-CPU device unless
    ``allow_device_read`` is true (its live size is only in device memory).
    """
    # Plain tensors first: `type(...) is` is far cheaper than attribute lookups that a
    # tensor subclass could route through __torch_function__.
    if type(t) is torch.Tensor:
        if t.layout is not torch.strided:
            if t.is_nested:  # the C++ strided nested layout: numel counts the elements
                return t.numel() * t.element_size()
            return None
        return t.numel() * t.element_size()
    if isinstance(t, NestedTensor):
        return _jagged_nbytes(t, allow_device_read)
    # Other subclasses (parameters, wrappers): the ordinary definition.
    if t.layout is not torch.strided:
        return None
    return t.numel() * t.element_size()


def _jagged_nbytes(nt: NestedTensor, allow_device_read: bool) -> int | None:
    """Packed value bytes of a jagged nested tensor (private attributes: cheap)."""
    values = nt._values
    lengths = nt._lengths
    if lengths is None:
        # torch's invariant for a non-holey NJT: _values is exactly the packed rows.
        return values.numel() * values.element_size()
    if values.device.type != "cpu" and not allow_device_read:
        return None  # the live row count is in device memory: unknown, not a stall
    ragged_dim = nt._ragged_idx - 1  # the dim of _values that the offsets index
    rows = values.shape[ragged_dim]
    if rows == 0:
        return 0
    row_elems = values.numel() // rows
    live = int(lengths.sum())  # syncless: ok CPU read, or device read the caller allowed
    return live * row_elems * values.element_size()


def _int_size(v: int) -> int | None:
    """msgpack size of an int (msgpack-python picks the smallest encoding)."""
    if v >= 0:
        if v < 0x80:
            return 1  # positive fixint
        if v <= 0xFF:
            return 2  # uint8
        if v <= 0xFFFF:
            return 3  # uint16
        if v <= _U32:
            return 5  # uint32
        if v <= 0xFFFFFFFFFFFFFFFF:
            return 9  # uint64
        return None  # packb raises OverflowError
    if v >= -32:
        return 1  # negative fixint
    if v >= -0x80:
        return 2  # int8
    if v >= -0x8000:
        return 3  # int16
    if v >= -0x80000000:
        return 5  # int32
    if v >= -0x8000000000000000:
        return 9  # int64
    return None


def _str_header(n: int) -> int | None:
    if n < 32:
        return 1  # fixstr
    if n <= 0xFF:
        return 2  # str8
    if n <= 0xFFFF:
        return 3  # str16
    if n <= _U32:
        return 5  # str32
    return None


def _bin_header(n: int) -> int | None:
    if n <= 0xFF:
        return 2  # bin8
    if n <= 0xFFFF:
        return 3  # bin16
    if n <= _U32:
        return 5  # bin32
    return None


def _container_header(n: int) -> int | None:
    # fixarray / fixmap hold up to 15 entries; then the 16- and 32-bit forms.
    if n < 16:
        return 1
    if n <= 0xFFFF:
        return 3
    if n <= _U32:
        return 5
    return None


def _ext_size(n: int) -> int | None:
    if n in (1, 2, 4, 8, 16):
        return 2 + n  # fixext: 1 B type marker + 1 B ext type + data
    if n <= 0xFF:
        return 3 + n  # ext8
    if n <= 0xFFFF:
        return 4 + n  # ext16
    if n <= _U32:
        return 6 + n  # ext32
    return None


def msgpack_size(obj: Any, max_items: int = 100_000) -> int | None:
    """``len(msgpack.packb(obj))`` without packing, or ``None`` when unknown.

    Unknown: a type packb cannot serialise, a value packb would reject, or a walk that
    would visit more than ``max_items`` objects (containers, keys and values all count).
    Type checks follow packb's order (``bool`` before ``int``; subclasses of the
    supported types count as their base, as packb's default ``strict_types=False``).
    """
    total = 0
    visited = 0
    stack: list[tuple[Any, int]] = [(obj, 0)]
    pop, push = stack.pop, stack.append
    while stack:
        o, depth = pop()
        visited += 1
        if visited > max_items or depth > _MSGPACK_MAX_DEPTH:
            return None
        if o is None or o is True or o is False:
            total += 1
        elif isinstance(o, int):  # bool is final: True/False were handled above
            n = _int_size(o)
            if n is None:
                return None
            total += n
        elif isinstance(o, float):
            total += 9  # float64 (packb's default use_single_float=False)
        elif isinstance(o, str):
            if o.isascii():
                n = len(o)
            else:
                try:
                    n = len(o.encode("utf-8"))
                except UnicodeEncodeError:  # lone surrogate: packb raises too
                    return None
            h = _str_header(n)
            if h is None:
                return None
            total += h + n
        elif isinstance(o, (bytes, bytearray, memoryview)):
            n = o.nbytes if isinstance(o, memoryview) else len(o)
            h = _bin_header(n)
            if h is None:
                return None
            total += h + n
        elif isinstance(o, msgpack.ExtType):  # a namedtuple: test before tuple
            if not isinstance(o.data, bytes):
                return None
            n = _ext_size(len(o.data))
            if n is None:
                return None
            total += n
        elif isinstance(o, (list, tuple)):
            h = _container_header(len(o))
            if h is None or visited + len(o) > max_items:
                return None  # fail fast: do not push a huge container item by item
            total += h
            d = depth + 1
            for item in o:
                push((item, d))
        elif isinstance(o, dict):
            h = _container_header(len(o))
            if h is None or visited + 2 * len(o) > max_items:
                return None
            total += h
            d = depth + 1
            for k, v in o.items():
                push((k, d))
                push((v, d))
        else:
            return None  # set, numpy scalar, tensor, arbitrary object: packb raises
    return total


def payload_nbytes(value: Any, *, allow_device_read: bool = False) -> int | None:
    """Wire bytes of a transfer payload, or ``None`` when unknown.

    A tensor counts ``tensor_nbytes``; a non-empty list/tuple of tensors the sum of its
    tensors (unknown if any is); anything else its exact msgpack size.
    """
    if isinstance(value, torch.Tensor):
        return tensor_nbytes(value, allow_device_read=allow_device_read)
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
        total = 0
        for t in value:
            if not isinstance(t, torch.Tensor):
                return None  # mixed tensors and objects: no single wire format
            n = tensor_nbytes(t, allow_device_read=allow_device_read)
            if n is None:
                return None
            total += n
        return total
    return msgpack_size(value)
