"""What ``CaptureEngine.capture()`` checks of its arguments, on every call.

Bad input raises ``ValueError`` saying what was expected; the checks are host
metadata only (no sync).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from syncless.cuda_driver import stream_capturing
from syncless.hot_path import hot_path

__all__ = ["check_capture", "check_defer", "check_meta"]


@hot_path
def check_capture(
    tag: str, tensor: torch.Tensor, step: int | None, device: torch.device, stream: int
) -> None:
    """A dense strided tensor on the engine's ``device``, a non-empty tag, an int step
    or None, and ``stream`` (the current raw CUDA stream; 0 on the CPU) not being
    captured into a CUDA graph."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"capture({tag!r}): expected a torch.Tensor, got {type(tensor)}")
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        raise ValueError(
            f"capture({tag!r}): only dense strided tensors can be captured, got layout "
            f"{tensor.layout}{' (quantized)' if tensor.is_quantized else ''}"
            f"{' (nested)' if tensor.is_nested else ''}; capture its dense parts instead"
        )
    if tensor.device != device:
        raise ValueError(
            f"capture({tag!r}): the tensor is on {tensor.device} but the engine captures "
            f"from {device}; make one engine per device"
        )
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"capture(): tag must be a non-empty string, got {tag!r}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise ValueError(f"capture({tag!r}): step must be an int or None, got {step!r}")
    # The legacy default stream (0) is never captured (CUDA refuses to), and asking
    # costs 0.35 us of the H200 host per call (bench/RESULTS.md, driver_calls at b038d84).
    if stream != 0 and stream_capturing():
        raise RuntimeError(
            f"capture({tag!r}) inside CUDA graph capture: the ring is reserved on the "
            f"host, which a graph replay does not run; capture outside the graph"
        )


def check_defer(tag: str, defer: Any) -> bool:
    if not isinstance(defer, bool):
        raise ValueError(f"capture({tag!r}): defer must be a bool or None, got {defer!r}")
    return defer


def check_meta(meta: Mapping[str, Any]) -> str:
    """``capture()``'s ``meta`` as JSON text, serialised at the call (a snapshot)."""
    if not isinstance(meta, Mapping):
        raise ValueError(f"capture(): meta must be a mapping, got {type(meta).__name__}")
    try:
        return json.dumps(dict(meta), separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"capture(): meta must be JSON-serialisable (numbers, strings, lists, dicts; "
            f"not tensors, which would need a sync): {e}"
        ) from None
