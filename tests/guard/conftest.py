"""Shared helpers for the guard tests."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest
import torch


def _marked_line(fn: Callable[..., object], marker: str = "# SYNC") -> int:
    """The file line of the one source line of ``fn`` that carries ``marker``.

    Ground truth for the site a sync must be reported at, read from the source text
    rather than from anything the guard computes.
    """
    lines, first = inspect.getsourcelines(fn)
    hits = [first + i for i, text in enumerate(lines) if text.rstrip().endswith(marker)]
    assert len(hits) == 1, f"{fn.__name__} must mark exactly one line with {marker!r}"
    return hits[0]


@pytest.fixture
def marked_line() -> Callable[..., int]:
    return _marked_line


@pytest.fixture(autouse=True)
def _no_mode_leaks() -> object:
    """Every test must leave torch's mode stacks and autograd engine as it found them."""
    before = (
        torch._C._len_torch_function_stack(),
        torch._C._len_torch_dispatch_stack(),
        getattr(torch.autograd, "_engine_run_backward", None),
    )
    yield
    after = (
        torch._C._len_torch_function_stack(),
        torch._C._len_torch_dispatch_stack(),
        getattr(torch.autograd, "_engine_run_backward", None),
    )
    assert after == before, "a guard left a torch mode or the engine wrapper behind"
