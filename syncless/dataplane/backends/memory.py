"""An in-process key-value tensor store that behaves like a real one.

It copies on put (a later in-place change by the writer does not reach the store) and
can hand dense fields back as jagged nested tensors, the way TransferQueue does since
0.1.8 ("put dense, get jagged").
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

from syncless.dataplane.client import Fields, FieldValue, field_rows


class InMemoryStore:
    def __init__(self, jagged_on_get: bool = False) -> None:
        self.jagged_on_get = jagged_on_get
        self._rows: dict[str, dict[str, dict[str, Any]]] = {}  # partition -> key -> field

    def put(self, partition: str, keys: Sequence[str], fields: Fields) -> None:
        store = self._rows.setdefault(partition, {})
        for name, value in fields.items():
            if field_rows(value) != len(keys):
                raise ValueError(
                    f"field {name!r} has {field_rows(value)} rows for {len(keys)} keys; "
                    "the first dimension of every field must run over the keys"
                )
        for name, value in fields.items():
            rows = value.unbind(0) if isinstance(value, torch.Tensor) else value
            for key, row in zip(keys, rows, strict=True):
                copied = row.clone() if isinstance(row, torch.Tensor) else copy.deepcopy(row)
                store.setdefault(key, {})[name] = copied

    def get(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None
    ) -> dict[str, FieldValue]:
        store = self._rows.get(partition, {})
        missing = [k for k in keys if k not in store]
        if missing:
            raise KeyError(
                f"keys not in partition {partition!r}: {missing[:5]}"
                + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            )
        names = list(fields) if fields is not None else list(store[keys[0]]) if keys else []
        out: dict[str, FieldValue] = {}
        for name in names:
            rows = [store[k][name] for k in keys]
            out[name] = self._assemble(rows)
        return out

    def _assemble(self, rows: list[Any]) -> FieldValue:
        if not rows or not isinstance(rows[0], torch.Tensor):
            return rows
        same_shape = all(r.shape == rows[0].shape for r in rows)
        if rows[0].dim() >= 1 and (self.jagged_on_get or not same_shape):
            return torch.nested.nested_tensor(rows, layout=torch.jagged)
        return torch.stack(rows)

    def clear(self, partition: str, keys: Sequence[str]) -> None:
        store = self._rows.get(partition, {})
        for k in keys:
            store.pop(k, None)

    def list_keys(self, partition: str) -> list[str]:
        return list(self._rows.get(partition, {}))
