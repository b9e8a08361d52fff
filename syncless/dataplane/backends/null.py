"""A store that stores nothing: for measuring a wrapper's own cost."""

from __future__ import annotations

from collections.abc import Sequence

from syncless.dataplane.client import Fields, FieldValue


class NullStore:
    """``put``/``clear`` do nothing; ``get`` returns the prepared ``fields`` as they are.

    Wrapping it isolates the wrapper's own work (timing, byte accounting, digests) from
    any real transfer.
    """

    def __init__(self, fields: Fields | None = None) -> None:
        self.fields = dict(fields or {})

    def put(self, partition: str, keys: Sequence[str], fields: Fields) -> None:
        pass

    def get(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None
    ) -> dict[str, FieldValue]:
        return dict(self.fields)

    def clear(self, partition: str, keys: Sequence[str]) -> None:
        pass

    def list_keys(self, partition: str) -> list[str]:
        return []
