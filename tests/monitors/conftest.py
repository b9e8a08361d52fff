"""Every monitor test runs twice: torch ops, and the fused Triton kernels.

On a machine without a GPU the Triton run uses the interpreter (tests/conftest.py);
on a CUDA machine these CPU-tensor tests run the torch path only, and
tests/kernels/test_kernels_cuda.py covers the compiled kernels.
"""

from __future__ import annotations

import pytest

from syncless import kernels


def _backends() -> list:
    triton = pytest.param(
        "triton",
        marks=pytest.mark.skipif(
            not (kernels.triton_importable() and kernels.interpreting()),
            reason="needs triton and TRITON_INTERPRET=1 (CPU-only machines)",
        ),
    )
    return ["torch", triton]


@pytest.fixture(autouse=True, params=_backends())
def kernel_backend(request, monkeypatch):
    """The backend of this test run; spawned ranks inherit it through the environment."""
    monkeypatch.setenv("SYNCLESS_KERNELS", request.param)
    previous = kernels.backend()
    kernels.set_backend(request.param)
    yield request.param
    kernels.set_backend(previous)
