"""``syncless demo --capture LAYERS``: hidden states out of training through the
capture engine (syncless.capture), every ``--capture-every`` steps.

Each chosen block's output (the residual stream after the block) is captured in the
block's forward hook: a device-to-device copy into the engine's ring, drained to
``RUN_DIR/captures/`` by the engine's worker; read it back with
``syncless.capture.open(run_dir)``. Tags are ``layer_XX/hidden``. With
``--capture-point moe_input`` it is the MoE block's input instead (``layer_XX/moe_input``,
the normalised residual its router reads), captured in the MoE block's forward-pre-hook:
right before the router and the token dispatch, the worst place for a D2H copy to
compete with an all-to-all, and what ``bench/capture/windows.py --point moe_input``
measures windows against.

``--capture-windows`` (expert parallel): every all-to-all of the MoE layers is in a
critical region: the token dispatch and combine (forward and backward). The counts
exchange before a dispatch opens the dispatch's region: the region runs from before
the counts exchange, through the host's read of the counts, to after the dispatch. A
boundary is published on the stream at each region's begin and end, so boundaries
alternate begin / end, and the drain's D2H traffic goes between the regions (expert
compute, attention, ...). The recurring pattern is one training step: step 0 runs
without windows and counts its regions, m; from step 1 on the pattern is
``WindowPattern(period=2m, windows=[(1, 2), (3, 4), ...])``, so each gap of the step is
its own window position, with its own learnt byte budget (the gap across attention is
milliseconds, the one across an expert computation far less: one budget shared by all
of them overran the short ones on the H200s, at dbf18fc). A step whose all-to-alls
differ in number would shift the pattern: the demo's steps do not.

Why the counts exchange and its dispatch share a region: the counts exchange moves a
few bytes, but its NCCL kernel runs, and spins, until the late rank arrives (left
unbracketed, window copies overlapped it on the H200s, bench/capture/windows.py at
b8113e6); bracketed on its own, the window between it and the dispatch is the host's
read of the counts, tens of microseconds on the device timeline, which no captured
record fits and which a copy issued there could only overrun into the dispatch.
"""

from __future__ import annotations

import torch
from torch import nn

from syncless.capture import CaptureEngine, WindowPattern
from syncless.demo.dispatch import AllToAllDispatcher
from syncless.demo.tools import DemoContext
from syncless.errors import UsageError

MIB = 1 << 20
#: What ``--capture-point`` captures of each chosen layer.
POINTS = ("hidden", "moe_input")


def parse_layers(spec: str, n_layers: int, where: str = "") -> list[int]:
    """``all`` or a comma list of layer indices, checked against the model.

    ``where``: what set the layer count, for the error (e.g. ``--preset tiny``).
    """
    if spec.strip() == "all":
        return list(range(n_layers))
    try:
        layers = sorted({int(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        layers = []
    if not layers or not all(0 <= i < n_layers for i in layers):
        source = f" ({where})" if where else ""
        raise UsageError(
            f"--capture {spec!r}: the model has {n_layers} layer(s){source}; expected 'all' "
            f"or a comma list of layer indices in 0..{n_layers - 1}, e.g. --capture "
            f"0,{n_layers - 1}"
        )
    return layers


class CaptureTool:
    name = "capture"

    def __init__(
        self, layers: str, every: int = 10, windows: bool = False, point: str = "hidden"
    ) -> None:
        if every < 1:
            raise UsageError(f"--capture-every must be >= 1, got {every}")
        if point not in POINTS:
            raise UsageError(f"--capture-point {point!r}: expected one of {', '.join(POINTS)}")
        self.spec, self.every, self.windows, self.point = layers, every, windows, point
        self.engine: CaptureEngine | None = None
        self._handles: list = []
        self._step = 0
        self._first_step: int | None = None  # the loop's (a resumed run's is not 0)
        self._on = False
        self._comms = 0  # critical regions so far (step 0's set the pattern)
        self._in_region = False  # a counts exchange opened one its dispatch will end
        self._pattern_defined = False

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
            capture = self._capture_fn(f"layer_{i:02d}/{self.point}")
            if self.point == "hidden":  # the block's output: (hidden, balance)
                handle = blocks[i].register_forward_hook(lambda _m, _a, out, c=capture: c(out[0]))
            else:  # the MoE block's input, before its router runs
                moe: nn.Module = blocks[i].moe  # type: ignore[assignment]
                handle = moe.register_forward_pre_hook(lambda _m, args, c=capture: c(args[0]))
            self._handles.append(handle)
        if self.windows:
            self._bracket_all_to_alls(ctx)

    def _bracket_all_to_alls(self, ctx: DemoContext) -> None:
        dispatchers = {
            id(m.dispatcher): m.dispatcher
            for m in ctx.model.modules()
            if isinstance(getattr(m, "dispatcher", None), AllToAllDispatcher)
        }
        if not ctx.expert_parallel or not dispatchers:
            raise UsageError(
                "--capture-windows brackets the expert-parallel all-to-alls: it needs "
                "--expert-parallel and more than one rank"
            )
        for dispatcher in dispatchers.values():  # once each: layers may share one
            dispatcher.comm = self._bracketed(dispatcher.comm)

    def _define_step_pattern(self) -> None:
        """From the regions counted in step 0: one window after each (see module)."""
        assert self.engine is not None
        m = self._comms
        if m == 0:
            raise UsageError("--capture-windows: step 0 ran no expert-parallel all-to-all")
        # Step 0's records leave by batching, as the step ran: left in the ring (the
        # drain looks every quarter ring or 50 ms), they would fill the first windows
        # with traffic those windows were not planned for. One host wait, once.
        self.engine.flush()
        self.engine.define_pattern(
            WindowPattern(period=2 * m, windows=[(2 * j + 1, 2 * j + 2) for j in range(m)])
        )
        self._pattern_defined = True

    def _bracketed(self, comm):
        engine = self.engine
        assert engine is not None

        def bracketed(name: str, fn, *args, **kwargs):
            if not name.startswith(("moe_counts", "moe_dispatch", "moe_combine")):
                return comm(name, fn, *args, **kwargs)
            if not self._in_region:
                self._comms += 1
                engine.advance_boundary()  # the critical region begins
                self._in_region = True
            try:
                return comm(name, fn, *args, **kwargs)
            finally:
                if not name.startswith("moe_counts"):  # its dispatch ends the region
                    engine.advance_boundary()  # ... and ends: a window opens
                    self._in_region = False

        return bracketed

    def _capture_fn(self, tag: str):
        def capture(x: torch.Tensor) -> None:
            if self._on and torch.is_grad_enabled():  # the training forward only
                assert self.engine is not None
                self.engine.capture(tag, x.detach(), step=self._step)

        return capture

    def step_begin(self, step: int) -> None:
        self._step = step
        if self._first_step is None:
            self._first_step = step
        self._on = step % self.every == 0
        if self.windows and step > self._first_step and not self._pattern_defined:
            self._define_step_pattern()

    def step_end(self, step: int) -> None:
        # With windows the boundaries cost host time every step, captured or not.
        if (self._on or self.windows) and self.engine is not None:
            self.engine.report(step)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        if self.engine is not None:
            self.engine.close()
