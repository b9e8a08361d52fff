"""``FUNCTION_RULES``: the Python-level tensor API that syncs, keyed by function.

A ``TorchFunctionMode`` sees ``Tensor.item``, ``Tensor.__bool__``, ``Tensor.cpu``...
before they reach the dispatcher; on a CPU build ``tolist``, ``numpy``, ``cpu`` and
``repr`` never reach it at all, so they can only be caught here, by name. The host
copies (``.to('cpu')``, ``copy_`` into host memory) get their own predicates: only
some of their argument combinations wait for the device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from syncless.guard._rule_base import (
    _BRANCH_HINT,
    _HOST_COPY_HINT,
    _PRINT_HINT,
    _SCALAR_HINT,
    OpInfo,
    Predicate,
    Rule,
    _arg,
    _self_on_device,
    on_device,
)


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
