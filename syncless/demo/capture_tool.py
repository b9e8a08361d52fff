"""``syncless demo --capture LAYERS``: hidden states out of training through the
capture engine (syncless.capture), every ``--capture-every`` steps.

Each chosen block's output (the residual stream after the block) is captured in the
block's forward hook: a device-to-device copy into the engine's ring, drained to
``RUN_DIR/captures/`` by the engine's worker; read it back with
``syncless.capture.open(run_dir)``. Tags are ``layer_XX/hidden``.
"""

from __future__ import annotations

import torch
from torch import nn

from syncless.capture import CaptureEngine
from syncless.demo.tools import DemoContext
from syncless.errors import UsageError

MIB = 1 << 20


def parse_layers(spec: str, n_layers: int) -> list[int]:
    """``all`` or a comma list of layer indices, checked against the model."""
    if spec.strip() == "all":
        return list(range(n_layers))
    try:
        layers = sorted({int(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        layers = []
    if not layers or not all(0 <= i < n_layers for i in layers):
        raise UsageError(
            f"--capture {spec!r}: expected 'all' or a comma list of layer indices in "
            f"0..{n_layers - 1}, e.g. --capture 0,{n_layers - 1}"
        )
    return layers


class CaptureTool:
    name = "capture"

    def __init__(self, layers: str, every: int = 10) -> None:
        if every < 1:
            raise UsageError(f"--capture-every must be >= 1, got {every}")
        self.spec, self.every = layers, every
        self.engine: CaptureEngine | None = None
        self._handles: list = []
        self._step = 0
        self._on = False

    def attach(self, ctx: DemoContext) -> None:
        cfg = ctx.cfg
        layers = parse_layers(self.spec, cfg.n_layers)
        device = next(ctx.model.parameters()).device
        # The residual stream stays fp32 under autocast; a step's captures, 4 times over,
        # so the drain has several steps of slack before anything is dropped.
        record = cfg.batch_size * cfg.seq_len * cfg.d_model * 4
        per_step = record * len(layers)
        ring = max(4 * per_step, 16 * MIB)
        staging = min(ring, max(2 * record, 8 * MIB))
        self.engine = CaptureEngine(ring, staging, device=device, run=ctx.run)
        blocks: nn.ModuleList = ctx.model.layers  # type: ignore[assignment]
        for i in layers:
            self._handles.append(
                blocks[i].register_forward_hook(self._hook(f"layer_{i:02d}/hidden"))
            )

    def _hook(self, tag: str):
        def capture(_module: nn.Module, _args: tuple, output: tuple[torch.Tensor, ...]) -> None:
            if self._on and torch.is_grad_enabled():  # the training forward only
                assert self.engine is not None
                self.engine.capture(tag, output[0].detach(), step=self._step)

        return capture

    def step_begin(self, step: int) -> None:
        self._step = step
        self._on = step % self.every == 0

    def step_end(self, step: int) -> None:
        if self._on and self.engine is not None:
            self.engine.report(step)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        if self.engine is not None:
            self.engine.close()
