"""``syncless demo --dataplane``: training batches flow through a key-value store.

A producer (standing in for a rollout worker) puts each step's batch into an
in-process store, one key per sequence; the trainer gets the keys back (dense in,
jagged out, like TransferQueue), verifies the wire digests, and clears them. The
``MetricsClient`` around the store reports what that costs per op and as a share of
the step (``dataplane/step/*``).
"""

from __future__ import annotations

import time

import torch

from syncless.dataplane.backends.memory import InMemoryStore
from syncless.dataplane.metrics_client import MetricsClient
from syncless.demo.tools import DemoContext


def _dense(field: torch.Tensor) -> torch.Tensor:
    """A jagged field whose rows share one length, back as a dense [rows, length]."""
    if not field.is_nested:
        return field
    return torch.stack(field.unbind())


class DataplaneTool:
    name = "dataplane"

    def __init__(self, verify_hash: bool = True) -> None:
        self.client = MetricsClient(InMemoryStore(jagged_on_get=True), verify_hash=verify_hash)
        self._step_start: float | None = None

    def attach(self, ctx: DemoContext) -> None:
        self.ctx = ctx
        produce = ctx.batches
        rank = ctx.run.ranks.rank
        assert produce is not None

        def through_the_store(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            inputs, targets = produce(step)
            keys = [f"s{step}-r{rank}-{i}" for i in range(inputs.shape[0])]
            self.client.put("train", keys, {"inputs": inputs, "targets": targets})
            got = self.client.get("train", keys, ["inputs", "targets"])
            self.client.clear("train", keys)
            return _dense(got["inputs"]), _dense(got["targets"])

        ctx.batches = through_the_store

    def step_begin(self, step: int) -> None:
        self._step_start = time.perf_counter()

    def step_end(self, step: int) -> None:
        step_ms = (time.perf_counter() - self._step_start) * 1e3 if self._step_start else None
        self.ctx.run.log(step, self.client.step(step_wall_ms=step_ms))

    def close(self) -> None:
        pass
