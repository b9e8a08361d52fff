"""Which calls would force a device-to-host sync on a GPU, and what to do instead.

Two tables. ``FUNCTION_RULES`` is keyed by the Python-level tensor API that a
``TorchFunctionMode`` sees (``Tensor.item``, ``Tensor.__bool__``, ...): on a CPU build
``tolist``, ``numpy``, ``cpu`` and ``repr`` never reach the dispatcher, so they can
only be caught by name. ``DISPATCH_RULES`` is keyed by aten overload packet, for ops
whose output shape or result depends on tensor values (``nonzero``, bool-mask
indexing, ...), which a ``TorchDispatchMode`` sees whatever Python API produced them.

Each rule is a predicate over the call's arguments, because most of these calls only
sync when their input lives on the device: with ``cpu_as_device`` every CPU tensor is
treated as if it lived on the GPU (the CPU-build simulation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["DISPATCH_RULES", "FUNCTION_RULES", "DispatchRule", "OpInfo", "Rule", "on_device"]


@dataclass(frozen=True, slots=True)
class OpInfo:
    """A detectable operation: stable name, what the user wrote, how to avoid it."""

    name: str
    what: str
    hint: str


# (args, kwargs, cpu_as_device) -> would this call sync?
Predicate = Callable[[tuple[Any, ...], Mapping[str, Any], bool], bool]


@dataclass(frozen=True, slots=True)
class Rule:
    info: OpInfo
    applies: Predicate


def on_device(value: object, cpu_as_device: bool) -> bool:
    """True when ``value`` is a tensor whose data lives (or is treated as living) on a device."""
    if not isinstance(value, torch.Tensor):
        return False
    kind = value.device.type
    if kind == "meta":
        return False
    return cpu_as_device if kind == "cpu" else True


def _self_on_device(args: tuple[Any, ...], kwargs: Mapping[str, Any], cpu_as_device: bool) -> bool:
    return bool(args) and on_device(args[0], cpu_as_device)


def _always(args: tuple[Any, ...], kwargs: Mapping[str, Any], cpu_as_device: bool) -> bool:
    return True


def _arg(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], pos: int, name: str, default: Any
) -> Any:
    if len(args) > pos:
        return args[pos]
    return kwargs.get(name, default)


def _as_device(value: object) -> torch.device | None:
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str):
        return torch.device(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    return None


def _to_host(args: tuple[Any, ...], kwargs: Mapping[str, Any], cpu_as_device: bool) -> bool:
    """``Tensor.to(...)`` that copies a device tensor into host memory and waits.

    A dtype-only or device-to-device ``.to`` is fine, and so is
    ``.to("cpu", non_blocking=True)``: torch then allocates a pinned output and
    does not wait. A target given as a tensor (``x.to(other)``) follows that
    tensor's device; in the CPU simulation it counts as a device tensor, and so does a
    ``torch.device`` object equal to the tensor's own: ``x.to(device=y.device)`` is how
    model code keeps tensors together (Hugging Face's rotary embedding moves
    ``inv_freq`` to the input's device every forward), a no-op on a GPU, where both
    are on it. A string ``"cpu"`` or ``.cpu()`` is a host copy there. The blind spot:
    a host copy written ``x.to(torch.device("cpu"))`` passes the CPU simulation (on a
    GPU it is caught).
    """
    if not args or not on_device(args[0], cpu_as_device):
        return False
    rest = args[1:]
    first = rest[0] if rest else kwargs.get("device", kwargs.get("tensor"))
    if isinstance(first, torch.Tensor):
        if cpu_as_device or first.device.type != "cpu":
            return False
        non_blocking = _arg(rest, kwargs, 1, "non_blocking", False)
        return not non_blocking
    if isinstance(first, torch.dtype):
        return False
    if cpu_as_device and isinstance(first, torch.device) and first == args[0].device:
        return False
    device = _as_device(first)
    if device is None or device.type != "cpu":
        return False
    return not _arg(rest, kwargs, 2, "non_blocking", False)


def _copy_into_host(args: tuple[Any, ...], kwargs: Mapping[str, Any], cpu_as_device: bool) -> bool:
    """A blocking ``host.copy_(device_tensor)``.

    Only decidable with real devices: on a CPU build both sides are CPU tensors, and
    treating both as device tensors makes this a device-to-device copy.
    """
    src = args[1] if len(args) > 1 else kwargs.get("src")
    dst = args[0] if args else None
    if not isinstance(dst, torch.Tensor) or not isinstance(src, torch.Tensor):
        return False
    if dst.device.type != "cpu" or src.device.type in ("cpu", "meta"):
        return False
    return not _arg(args, kwargs, 2, "non_blocking", False)


_HOST_COPY_HINT = (
    "keep the tensor on the device; to read it, copy it into a pinned host buffer with "
    "buf.copy_(x, non_blocking=True) (or x.to('cpu', non_blocking=True)) and read the "
    "buffer after the step's one synchronization point"
)
_SCALAR_HINT = (
    "keep the value on the device as a 0-dim tensor (accumulate into a device buffer) "
    "and read it back once per step in a batched, lagged copy"
)
_BRANCH_HINT = (
    "do not branch in Python on tensor values: use torch.where(cond, a, b), masking or "
    "clamp, and keep the result on the device"
)
_PRINT_HINT = (
    "record the value as a device-side metric (or format it outside the hot path, "
    "after the step's synchronization point)"
)


def _tensor_rules() -> dict[object, Rule]:
    t = torch.Tensor
    entries: list[tuple[object, OpInfo, Predicate]] = [
        (
            t.item,
            OpInfo("Tensor.item", "Tensor.item() copies the value to the host", _SCALAR_HINT),
            _self_on_device,
        ),
        (
            t.tolist,
            OpInfo(
                "Tensor.tolist", "Tensor.tolist() copies the tensor to the host", _HOST_COPY_HINT
            ),
            _self_on_device,
        ),
        (
            t.numpy,
            OpInfo("Tensor.numpy", "Tensor.numpy() needs the data in host memory", _HOST_COPY_HINT),
            _self_on_device,
        ),
        (
            t.__array__,
            OpInfo(
                "Tensor.__array__",
                "numpy conversion (np.asarray(tensor)) copies the tensor to the host",
                _HOST_COPY_HINT,
            ),
            _self_on_device,
        ),
        (
            t.cpu,
            OpInfo("Tensor.cpu", "Tensor.cpu() is a blocking device-to-host copy", _HOST_COPY_HINT),
            _self_on_device,
        ),
        (
            t.to,
            OpInfo(
                "Tensor.to", "Tensor.to('cpu') is a blocking device-to-host copy", _HOST_COPY_HINT
            ),
            _to_host,
        ),
        (
            t.copy_,
            OpInfo(
                "Tensor.copy_",
                "a blocking copy_ from a device tensor into host memory",
                _HOST_COPY_HINT,
            ),
            _copy_into_host,
        ),
        (
            t.__bool__,
            OpInfo(
                "Tensor.__bool__",
                "bool(tensor) / `if tensor:` reads the value on the host",
                _BRANCH_HINT,
            ),
            _self_on_device,
        ),
        (
            t.is_nonzero,
            OpInfo(
                "Tensor.is_nonzero", "Tensor.is_nonzero() reads the value on the host", _BRANCH_HINT
            ),
            _self_on_device,
        ),
        (
            t.__float__,
            OpInfo("Tensor.__float__", "float(tensor) copies the value to the host", _SCALAR_HINT),
            _self_on_device,
        ),
        (
            t.__int__,
            OpInfo("Tensor.__int__", "int(tensor) copies the value to the host", _SCALAR_HINT),
            _self_on_device,
        ),
        (
            t.__index__,
            OpInfo(
                "Tensor.__index__",
                "using a tensor as a Python index (range(t), lst[t]) copies it to the host",
                _SCALAR_HINT,
            ),
            _self_on_device,
        ),
        (
            t.__complex__,
            OpInfo(
                "Tensor.__complex__", "complex(tensor) copies the value to the host", _SCALAR_HINT
            ),
            _self_on_device,
        ),
        (
            t.__contains__,
            OpInfo(
                "Tensor.__contains__",
                "`x in tensor` reads a bool on the host",
                "compute (tensor == x).any() and keep it on the device",
            ),
            _self_on_device,
        ),
        (
            t.__repr__,
            OpInfo(
                "Tensor.__repr__",
                "repr()/str()/print() of a tensor reads its values on the host",
                _PRINT_HINT,
            ),
            _self_on_device,
        ),
        (
            t.__format__,
            OpInfo(
                "Tensor.__format__",
                "an f-string or format() of a tensor reads its values on the host",
                _PRINT_HINT,
            ),
            _self_on_device,
        ),
    ]
    return {func: Rule(info, applies) for func, info, applies in entries}


FUNCTION_RULES: dict[object, Rule] = _tensor_rules()


_MASK_DTYPES = (torch.bool, torch.uint8)


def _has_mask_index(indices: object) -> bool:
    if not isinstance(indices, (list, tuple)):
        return False
    return any(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in indices)


def _mask_index(args: tuple[Any, ...], kwargs: Mapping[str, Any], cpu_as_device: bool) -> bool:
    return _self_on_device(args, kwargs, cpu_as_device) and _has_mask_index(
        _arg(args, kwargs, 1, "indices", ())
    )


def _mask_assign(args: tuple[Any, ...], kwargs: Mapping[str, Any], cpu_as_device: bool) -> bool:
    """``x[mask] = value``: syncs unless ATen can turn it into ``masked_fill_``.

    ATen takes the masked_fill path (no sync) when there is exactly one index, a
    bool/uint8 mask, and the value is a one-element tensor in host memory, which is
    what a Python scalar becomes. A one-element *device* tensor value syncs; in the
    CPU simulation it cannot be told apart from a Python scalar and is let through.
    """
    if not _self_on_device(args, kwargs, cpu_as_device):
        return False
    indices = _arg(args, kwargs, 1, "indices", ())
    if not _has_mask_index(indices):
        return False
    if _arg(args, kwargs, 3, "accumulate", False):
        return True  # masked_fill is only tried without accumulate
    value = _arg(args, kwargs, 2, "values", None)
    defined = [i for i in indices if i is not None]
    scalar_value = (
        isinstance(value, torch.Tensor)
        and value.numel() == 1
        and not on_device(value, cpu_as_device=False)
    )
    return not (len(defined) == 1 and scalar_value)


def _repeats_tensor(args: tuple[Any, ...], kwargs: Mapping[str, Any], cpu_as_device: bool) -> bool:
    return _self_on_device(args, kwargs, cpu_as_device) and kwargs.get("output_size") is None


def _histc_range_from_data(
    args: tuple[Any, ...], kwargs: Mapping[str, Any], cpu_as_device: bool
) -> bool:
    low = _arg(args, kwargs, 2, "min", 0)
    high = _arg(args, kwargs, 3, "max", 0)
    return _self_on_device(args, kwargs, cpu_as_device) and low == high


_SHAPE_HINT = (
    "keep shapes static: use torch.where(mask, x, 0) / masked arithmetic over the full "
    "tensor, or nonzero_static(size=...) when indices are really needed"
)


@dataclass(frozen=True, slots=True)
class _DispatchEntry:
    packet: str
    overloads: frozenset[str] | None  # None: every overload
    info: OpInfo
    applies: Predicate


_DISPATCH_ENTRIES: tuple[_DispatchEntry, ...] = (
    _DispatchEntry(
        "_local_scalar_dense",
        None,
        OpInfo(
            "aten._local_scalar_dense",
            "a tensor value is read on the host (.item(), float(), int(), bool(), `if tensor:`)",
            _SCALAR_HINT,
        ),
        _self_on_device,
    ),
    _DispatchEntry(
        "is_nonzero",
        None,
        OpInfo("aten.is_nonzero", "a tensor is tested for truth on the host", _BRANCH_HINT),
        _self_on_device,
    ),
    _DispatchEntry(
        "nonzero",
        None,
        OpInfo(
            "aten.nonzero",
            "nonzero (torch.nonzero, torch.where(cond), argwhere) has a data-dependent output shape",
            _SHAPE_HINT,
        ),
        _self_on_device,
    ),
    _DispatchEntry(
        "_unique",
        None,
        OpInfo(
            "aten._unique",
            "unique has a data-dependent output shape",
            "count into a fixed-size buffer (zeros(n).scatter_add_) instead of unique",
        ),
        _self_on_device,
    ),
    _DispatchEntry(
        "_unique2",
        None,
        OpInfo(
            "aten._unique2",
            "torch.unique has a data-dependent output shape",
            "count into a fixed-size buffer (zeros(n).scatter_add_) instead of unique",
        ),
        _self_on_device,
    ),
    _DispatchEntry(
        "unique_dim",
        None,
        OpInfo(
            "aten.unique_dim",
            "torch.unique(dim=...) has a data-dependent output shape",
            "count into a fixed-size buffer instead of unique",
        ),
        _self_on_device,
    ),
    _DispatchEntry(
        "unique_consecutive",
        None,
        OpInfo(
            "aten.unique_consecutive",
            "unique_consecutive has a data-dependent output shape",
            "count into a fixed-size buffer instead of unique_consecutive",
        ),
        _self_on_device,
    ),
    _DispatchEntry(
        "unique_dim_consecutive",
        None,
        OpInfo(
            "aten.unique_dim_consecutive",
            "unique_consecutive(dim=...) has a data-dependent output shape",
            "count into a fixed-size buffer instead of unique_consecutive",
        ),
        _self_on_device,
    ),
    _DispatchEntry(
        "masked_select",
        None,
        OpInfo(
            "aten.masked_select", "masked_select has a data-dependent output shape", _SHAPE_HINT
        ),
        _self_on_device,
    ),
    _DispatchEntry(
        "repeat_interleave",
        frozenset({"Tensor", "self_Tensor"}),
        OpInfo(
            "aten.repeat_interleave",
            "repeat_interleave with tensor repeats reads their sum on the host to size the output",
            "pass output_size=<known total> to repeat_interleave",
        ),
        _repeats_tensor,
    ),
    _DispatchEntry(
        "equal",
        None,
        OpInfo(
            "aten.equal",
            "torch.equal returns a Python bool",
            "compare on the device: (a == b).all() kept as a tensor",
        ),
        _self_on_device,
    ),
    _DispatchEntry(
        "allclose",
        None,
        OpInfo(
            "aten.allclose",
            "torch.allclose returns a Python bool",
            "compare on the device: torch.isclose(a, b).all() kept as a tensor",
        ),
        _self_on_device,
    ),
    _DispatchEntry(
        "bincount",
        None,
        OpInfo(
            "aten.bincount",
            "bincount reads max(input) on the host to size its output",
            "count with torch.zeros(n).scatter_add_(0, idx, ones) for a known n",
        ),
        _self_on_device,
    ),
    _DispatchEntry(
        "histc",
        None,
        OpInfo(
            "aten.histc",
            "histc with min == max reads the input's min and max on the host",
            "pass explicit min and max (min < max) to histc",
        ),
        _histc_range_from_data,
    ),
    _DispatchEntry(
        "_pin_memory",
        None,
        OpInfo(
            "aten._pin_memory",
            "pinning allocates page-locked host memory, which serializes the device",
            "pin a buffer once at setup and copy into it with copy_(non_blocking=True)",
        ),
        _always,
    ),
    _DispatchEntry(
        "_linalg_check_errors",
        None,
        OpInfo(
            "aten._linalg_check_errors",
            "torch.linalg error checking (cholesky, inv, solve, ...) reads `info` on the host",
            "use the *_ex variant (cholesky_ex, inv_ex, solve_ex, ...) and keep `info` on the device",
        ),
        _self_on_device,
    ),
    _DispatchEntry(
        "index",
        frozenset({"Tensor", "Tensor_out"}),
        OpInfo(
            "aten.index",
            "boolean-mask indexing (x[mask]) has a data-dependent output shape",
            _SHAPE_HINT,
        ),
        _mask_index,
    ),
    _DispatchEntry(
        "index_put_",
        None,
        OpInfo(
            "aten.index_put_",
            "assignment through a boolean mask (x[mask] = tensor) calls nonzero",
            "use torch.where(mask, value, x), x.masked_fill_(mask, scalar) or masked_scatter_",
        ),
        _mask_assign,
    ),
    _DispatchEntry(
        "index_put",
        None,
        OpInfo(
            "aten.index_put",
            "index_put with a boolean mask calls nonzero",
            "use torch.where(mask, value, x) or masked_fill",
        ),
        _mask_assign,
    ),
    _DispatchEntry(
        "_index_put_impl_",
        None,
        OpInfo(
            "aten._index_put_impl_",
            "index_put with a boolean mask calls nonzero",
            "use torch.where(mask, value, x) or masked_fill",
        ),
        _mask_assign,
    ),
)


@dataclass(frozen=True, slots=True)
class DispatchRule:
    overloads: frozenset[str] | None
    info: OpInfo
    applies: Predicate


def _dispatch_rules() -> dict[object, DispatchRule]:
    rules: dict[object, DispatchRule] = {}
    for entry in _DISPATCH_ENTRIES:
        # Ops come and go between torch versions; a missing one cannot be dispatched.
        packet = getattr(torch.ops.aten, entry.packet, None)
        if packet is not None:
            rules[packet] = DispatchRule(entry.overloads, entry.info, entry.applies)
    return rules


DISPATCH_RULES: dict[object, DispatchRule] = _dispatch_rules()
