"""``DISPATCH_RULES``: aten ops whose output shape or result depends on tensor values.

A ``TorchDispatchMode`` sees these (``nonzero``, ``unique``, bool-mask indexing,
``repeat_interleave`` without ``output_size``...) whatever Python API produced them.
The table is keyed by aten overload packet; an entry may name the overloads it
covers, and ops missing from the installed torch are left out.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from syncless.guard._rule_base import (
    _BRANCH_HINT,
    _SCALAR_HINT,
    OpInfo,
    Predicate,
    _always,
    _arg,
    _self_on_device,
    on_device,
)

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
