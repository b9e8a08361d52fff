"""Which kernels run: the backend from ``SYNCLESS_KERNELS`` or :func:`set_backend`.

The package docstring (:mod:`syncless.kernels`) says what each backend means. The
kernel modules read :func:`interpreting` from here, not from the package, whose
``__init__`` imports them lazily.
"""

from __future__ import annotations

import importlib.util
import os

import torch

__all__ = [
    "BACKENDS",
    "backend",
    "interpreting",
    "set_backend",
    "triton_importable",
    "use_triton",
]

BACKENDS = ("auto", "torch", "triton")

_backend = os.environ.get("SYNCLESS_KERNELS", "auto")
_triton_importable: bool | None = None


def _check(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(
            f"unknown kernel backend {name!r} (from SYNCLESS_KERNELS or set_backend); "
            f"expected one of {', '.join(BACKENDS)}"
        )
    return name


def set_backend(name: str) -> None:
    """Choose ``auto``, ``torch`` or ``triton`` for every monitor from now on."""
    global _backend
    _backend = _check(name)


def backend() -> str:
    return _check(_backend)


def triton_importable() -> bool:
    global _triton_importable
    if _triton_importable is None:
        _triton_importable = importlib.util.find_spec("triton") is not None
    return _triton_importable


def interpreting() -> bool:
    """Whether Triton kernels run in the CPU interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether the hot path for ``t`` runs the fused Triton kernels (host checks only)."""
    name = _backend
    if name == "torch" or torch.compiler.is_compiling():
        return False
    if name == "auto":
        return t.is_cuda and triton_importable()
    _check(name)
    if not triton_importable():
        raise RuntimeError(
            "SYNCLESS_KERNELS=triton but triton is not installed: pip install triton, or "
            "use SYNCLESS_KERNELS=auto"
        )
    if not t.is_cuda and not interpreting():
        raise RuntimeError(
            "SYNCLESS_KERNELS=triton on a CPU tensor needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before importing syncless, or use SYNCLESS_KERNELS=auto"
        )
    return True
