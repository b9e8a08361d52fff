"""The type lattice of the lint's inference: is a value a tensor, a boolean one?

The lattice is deliberately tiny. ``TENSOR`` and ``BOOL`` (a boolean tensor) are
tensors; ``SEQ`` is a tuple or list of tensors (a forward hook's ``input``); ``NOT``
is known not to be a tensor (a number, a string, ``.shape``, a module); ``UNKNOWN``
is everything else. Rules that depend on types (``int(t)``, ``if t:``, ``print(t)``)
fire only on ``TENSOR``/``BOOL`` (and ``SEQ`` for formatting), so ``UNKNOWN`` costs
recall, never precision.

This module holds the lattice and its joins; :mod:`syncless.lint.inference` infers
the type of an expression, :mod:`syncless.lint.declared_types` reads types off
annotations and parameter names.
"""

from __future__ import annotations

import enum


class T(enum.Enum):
    """The inferred kind of a value."""

    NOT = "not-tensor"
    UNKNOWN = "unknown"
    SEQ = "tensor-sequence"
    BOOL = "bool-tensor"
    TENSOR = "tensor"


Env = dict[str, T]
Shape = T | tuple["Shape", ...]
"""A type, or a tuple of types for a tuple display (``a, b = x.max(), 0``)."""

_MAY_ORDER = (T.NOT, T.UNKNOWN, T.SEQ, T.BOOL, T.TENSOR)


def is_tensor(t: T) -> bool:
    """Whether ``t`` is a tensor (boolean or not)."""
    return t is T.TENSOR or t is T.BOOL


def holds_tensor(t: T) -> bool:
    """Whether ``t`` is a tensor or a sequence of tensors."""
    return t is T.SEQ or is_tensor(t)


def merge_must(a: T, b: T) -> T:
    """Join at a control-flow merge: keep a type only if both paths agree on it."""
    if a is b:
        return a
    if is_tensor(a) and is_tensor(b):
        return T.TENSOR
    return T.UNKNOWN


def merge_may(a: T, b: T) -> T:
    """Join across call sites: a parameter that receives a tensor anywhere is one."""
    if {a, b} == {T.BOOL, T.TENSOR}:
        return T.TENSOR
    return max(a, b, key=_MAY_ORDER.index)


def element_of(t: T) -> T:
    """The type of an element when iterating or unpacking a value of type ``t``."""
    if t is T.SEQ:
        return T.TENSOR
    return t
