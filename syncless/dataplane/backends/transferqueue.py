"""TransferQueue (PyPI ``TransferQueue``, import ``transfer_queue``) as a KVClient.

Install with ``pip install -e ".[transferqueue]"``. TransferQueue runs on Ray: its
controller and each storage unit reserve one Ray CPU, so on a small machine Ray must
be started with more logical CPUs than cores (``num_cpus=4``) or ``tq.init`` hangs
(NOTES.md). Since 0.1.8 every tensor field comes back as a jagged nested tensor, even
when all rows have one shape: put dense, get jagged. Non-tensor fields travel as a
tensordict ``NonTensorStack`` and come back as a list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from syncless.dataplane.client import Fields, FieldValue


class TransferQueueStore:
    """The module-level TransferQueue KV API behind the syncless client protocol."""

    def __init__(
        self, storage_units: int = 1, storage_size: int = 64, ray_cpus: int | None = 4
    ) -> None:
        try:
            import ray
            import transfer_queue as tq
            from omegaconf import OmegaConf
        except ImportError as e:
            raise ImportError(
                f"TransferQueueStore needs TransferQueue and Ray ({e}); install them with "
                '`pip install -e ".[transferqueue]"`'
            ) from None
        self._tq = tq
        self._ray = ray
        self._started_ray = False
        if ray_cpus is not None and not ray.is_initialized():
            ray.init(num_cpus=ray_cpus, include_dashboard=False, log_to_driver=False)
            self._started_ray = True
        tq.init(
            OmegaConf.create(
                {
                    "backend": {
                        "storage_backend": "SimpleStorage",
                        "SimpleStorage": {
                            "num_data_storage_units": storage_units,
                            "total_storage_size": storage_size,
                        },
                    }
                }
            )
        )

    def put(self, partition: str, keys: Sequence[str], fields: Fields) -> None:
        from tensordict import NonTensorStack, TensorDict

        columns: dict[str, Any] = {
            name: value if isinstance(value, torch.Tensor) else NonTensorStack(*value)
            for name, value in fields.items()
        }
        batch = TensorDict(columns, batch_size=[len(keys)])
        self._tq.kv_batch_put(keys=list(keys), partition_id=partition, fields=batch)

    def get(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None
    ) -> dict[str, FieldValue]:
        batch = self._tq.kv_batch_get(
            keys=list(keys),
            partition_id=partition,
            select_fields=list(fields) if fields is not None else None,
        )
        out: dict[str, FieldValue] = {}
        for name in batch.keys():  # noqa: SIM118 - iterating a TensorDict walks rows
            value = batch.get(name)
            out[name] = value if isinstance(value, torch.Tensor) else list(value.tolist())
        return out

    def clear(self, partition: str, keys: Sequence[str]) -> None:
        self._tq.kv_clear(keys=list(keys), partition_id=partition)

    def list_keys(self, partition: str) -> list[str]:
        return list(self._tq.kv_list(partition).get(partition, {}))

    def close(self) -> None:
        self._tq.close()
        if self._started_ray:
            self._ray.shutdown()
