"""The key-value tensor client protocol the data-plane tools wrap.

A batch is a set of *fields* keyed by row: ``fields["obs"]`` is a tensor whose first
dimension runs over ``keys`` (dense, or a jagged nested tensor when rows differ in
length) or a list of per-key Python objects. RL rollout workers ``put`` batches,
trainers ``get`` them (any subset of keys and fields, in any order) and ``clear`` what
they consumed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

FieldValue = torch.Tensor | Sequence[Any]
Fields = Mapping[str, FieldValue]


@runtime_checkable
class KVClient(Protocol):
    def put(self, partition: str, keys: Sequence[str], fields: Fields) -> None:
        """Store one row per key of every field (the first dimension runs over keys)."""

    def get(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None
    ) -> dict[str, FieldValue]:
        """The rows of ``keys`` (in that order) of ``fields`` (default: all)."""

    def clear(self, partition: str, keys: Sequence[str]) -> None:
        """Drop the rows of ``keys``."""

    def list_keys(self, partition: str) -> list[str]:
        """Keys currently stored in ``partition``."""


def field_rows(value: FieldValue) -> int:
    """Rows of a field without touching its data (first dim of dense or jagged)."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return value._offsets.shape[0] - 1  # metadata only: no device read
        return value.shape[0]
    return len(value)
