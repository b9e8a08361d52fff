"""``capture_check()``: would this function survive CUDA graph capture?"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class CaptureResult:
    """Outcome of a dry-run capture: ``capturable``, and the error when it was not."""

    capturable: bool
    error: str | None = None


def _describe(exc: BaseException) -> str:
    # A failed capture usually raises twice: the op that broke it, then capture_end
    # from torch.cuda.graph's __exit__. The first one is the cause worth reading.
    chain: list[BaseException] = []
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__
    return "; then ".join(f"{type(e).__name__}: {e}" for e in reversed(chain))


def capture_check(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CaptureResult:
    """Dry-run ``fn(*args, **kwargs)`` under ``torch.cuda.graph`` capture.

    ``fn`` runs once eagerly on a side stream first (warm-up, as the CUDA graphs docs
    recommend: lazy initialization, library handles and allocator pools happen outside
    capture), then once under capture; the graph is discarded, never replayed. An
    exception in the warm-up is ``fn``'s own bug and propagates. ``fn``'s Python code
    runs twice (warm-up and capture) but its kernels run once: capture records them
    without running them.

    Needs CUDA; raises ``RuntimeError`` without it.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "capture_check() needs a CUDA device (torch.cuda.is_available() is False): "
            "it dry-runs CUDA graph capture, which does not exist on CPU. "
            "Run it on a GPU machine; tests that use it are marked @pytest.mark.cuda."
        )
    warmup = torch.cuda.Stream()
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):
        fn(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(warmup)
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn(*args, **kwargs)
    except Exception as exc:
        error = _describe(exc)
        del graph
        _reset_after_failed_capture()
        return CaptureResult(False, error)
    del graph
    torch.cuda.synchronize()
    return CaptureResult(True, None)


def _reset_after_failed_capture() -> None:
    """Leave CUDA as usable as before a capture that failed.

    When capture fails, ``capture_end`` raises before it reaches the RNG generators'
    capture epilogue, so they stay marked as capturing and the next random op raises
    "Offset increment outside graph capture encountered unexpectedly". One clean
    capture runs the prologue/epilogue pair again and clears that state.
    """
    torch.cuda.synchronize()
    scratch = torch.cuda.CUDAGraph()
    with torch.cuda.graph(scratch):
        torch.empty(1, device="cuda").zero_()
    del scratch
    torch.cuda.synchronize()
