"""CUDA graphs: whether the current work is being captured, and a CPU stand-in for tests.

A captured region's Python runs once, at capture; every replay re-runs only the device
work it enqueued, on the same memory. So a hook that decides on the host whether to
record (a cadence flag) decides once for every replay. Code that must work inside a
graph asks :func:`capturing` and, when it is True, enqueues its whole work and lets a
device flag decide at each replay (docs/cuda_graphs.md).

:class:`StandInGraph` captures and replays like ``torch.cuda.CUDAGraph`` on a CPU: it
records the aten ops a region dispatches (the forward, the backward, every hook's ops)
and a replay runs those ops again on the same tensors, and nothing else: no Python of
the region, no hook, no branch. CI has no GPU; this is how its tests see what a replay
would do with state that Python froze at capture.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

from syncless.cuda_driver import stream_capturing

__all__ = ["StandInGraph", "capturing"]

# Depth of StandInGraph captures in progress (any thread: a CPU backward runs on the
# thread that called it, and a test captures one region at a time).
_stand_in_depth = 0


def capturing(cuda: bool | None = None) -> bool:
    """Whether the current stream is being captured into a CUDA graph (or a
    :class:`StandInGraph` captures). ``cuda``: the work is on a CUDA device (a CPU
    build's capture query raises); None: ask only if CUDA is initialized. False while
    ``torch.compile`` traces: the query is a C call dynamo would break the graph on, and
    a compiled region is captured later, by the compiler (``mode="reduce-overhead"``),
    from its traced graph. About 0.2 us."""
    if cuda is False and not _stand_in_depth:  # the common CPU case, 0.05 us
        return False
    if torch.compiler.is_compiling():
        return False
    if _stand_in_depth > 0:
        return True
    if cuda is None:
        cuda = torch.cuda.is_initialized()
    return cuda and stream_capturing()


# Ops that read a device value on the host: under CUDA capture they fail the capture
# ("operation not permitted when stream is capturing"); the stand-in refuses them too.
_SYNCING = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.equal.default,
}


class _Recorder(TorchDispatchMode):
    """Runs and records every op; notes the memory that existed before the capture and
    that an op writes, with its old contents, to be put back when the capture ends."""

    def __init__(self, ops: list[tuple[Any, tuple, dict, Any]]) -> None:
        super().__init__()
        self.ops = ops
        self.created: set[int] = set()  # storages allocated during the capture
        self.overwritten: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, before)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if func in _SYNCING:
            raise RuntimeError(
                f"{func} reads a device value on the host inside a (stand-in) CUDA graph "
                "capture: on a GPU the capture fails"
            )
        if func._schema.is_mutable:
            self._keep_before_write(func, args, kwargs)
        out = func(*args, **kwargs)
        if not func.is_view and not func._schema.is_mutable:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.created.add(t.untyped_storage().data_ptr())
        self.ops.append((func, args, kwargs, out))
        return out

    def _keep_before_write(self, func: Any, args: tuple, kwargs: dict) -> None:
        """What a writing op is about to overwrite in memory older than the capture."""
        written = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
            written += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
        for t in written:
            if t.untyped_storage().data_ptr() not in self.created:
                self.overwritten.append((t, t.clone()))

    def launch(self, run: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """A Triton kernel launched through the CPU interpreter: recorded as one op (its
        own torch calls, copies to and from numpy, are not the kernel's work)."""
        with _disable_current_modes():
            for t in tree_flatten((args, kwargs))[0]:
                if (
                    isinstance(t, torch.Tensor)
                    and t.untyped_storage().data_ptr() not in self.created
                ):
                    self.overwritten.append((t, t.clone()))  # which it writes is unknown
            out = run(*args, **kwargs)
        self.ops.append((run, args, kwargs, None))
        return out

    def restore(self) -> None:
        """Memory older than the capture as it was before it (newest write first)."""
        for t, before in reversed(self.overwritten):
            t.copy_(before)
        self.overwritten.clear()


class StandInGraph:
    """A CPU stand-in for ``torch.cuda.CUDAGraph``.

    ::

        graph = StandInGraph()
        with graph.capture():  # records the region's aten ops
            loss = train_step(batch)
        for _ in range(20):
            graph.replay()  # those ops again, on the same tensors; no Python of the region
            handle.step(step, loss=loss)

    As a CUDA capture, the capture leaves memory as it found it: the stand-in runs the
    region once to record it (its Python needs the results), then puts back what the
    ops wrote into tensors older than the capture (parameters, gradients, a monitor's
    buffer); tensors the region made hold that run's values, where a CUDA graph's would
    hold garbage until the first replay. A replay writes every recorded op's result
    into the tensor the op returned at capture, so later ops read it there, as a graph's
    kernels read fixed addresses. In-place ops write their arguments again. Triton
    kernels run by the CPU interpreter (``TRITON_INTERPRET=1``) are recorded and
    replayed as ops. Ops that read a device value on the host (``.item()``,
    ``nonzero``) raise at capture, as a CUDA capture would fail. Tensors the region
    allocated stay alive with the graph.
    """

    def __init__(self) -> None:
        self._ops: list[tuple[Any, tuple, dict, Any]] = []
        self.captured = False
        self.replays = 0

    @contextmanager
    def capture(self) -> Iterator[None]:
        global _stand_in_depth
        if self.captured:
            raise RuntimeError("this StandInGraph was captured already; make a new one")
        recorder = _Recorder(self._ops)
        _stand_in_depth += 1
        try:
            with recorder, _interpreted_launches(recorder):
                yield
        finally:
            _stand_in_depth -= 1
            with torch.no_grad():
                recorder.restore()
        self.captured = True

    def replay(self) -> None:
        if not self.captured:
            raise RuntimeError("replay() before capture()")
        with torch.no_grad():
            for func, args, kwargs, out in self._ops:
                _write_back(out, func(*args, **kwargs))
        self.replays += 1


@contextmanager
def _interpreted_launches(recorder: _Recorder) -> Iterator[None]:
    """Triton's CPU interpreter (``TRITON_INTERPRET=1``, how CI runs the kernels) runs a
    launch in Python, below no aten op: record each launch as one op."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is None:
        yield
        return
    kernel_class = interpreter.InterpretedFunction
    original = kernel_class.run

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        return recorder.launch(lambda *a, **k: original(self, *a, **k), args, kwargs)

    kernel_class.run = run
    try:
        yield
    finally:
        kernel_class.run = original


def _write_back(captured: Any, result: Any) -> None:
    """Copy a replayed op's result into the tensors it returned at capture."""
    old, _ = tree_flatten(captured)
    new, _ = tree_flatten(result)
    for a, b in zip(old, new, strict=True):
        if not isinstance(a, torch.Tensor) or a is b:
            continue
        same_view = a.data_ptr() == b.data_ptr() and a.stride() == b.stride() and a.shape == b.shape
        if not same_view:  # a view of the same memory holds the result already
            a.copy_(b)
