"""What :class:`~syncless.capture.engine.CaptureEngine` checks and makes once, when built.

The sizes of the device ring and the staging ring against each other, the grant
controller against staging, and the readiness events of the record slots. The checks
of each argument on its own (the config, the policy, the device, the sink) are in
:mod:`syncless.capture.config`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from syncless.capture.config import EngineConfig, positive_int
from syncless.capture.controller import ControllerConfig, GrantController

__all__ = ["check_sizes", "event_factory", "resolve_controller"]


def check_sizes(
    ring_bytes: int, staging_bytes: int, config: EngineConfig | None
) -> tuple[EngineConfig, int, int]:
    """The config (default: ``EngineConfig()``) and both sizes, checked; staging fits in
    the ring."""
    cfg = config if config is not None else EngineConfig()
    if not isinstance(cfg, EngineConfig):
        raise ValueError(f"config must be an EngineConfig, got {type(cfg).__name__}")
    ring_bytes = positive_int(ring_bytes, "CaptureEngine: ring_bytes", cfg.align)
    staging_bytes = positive_int(staging_bytes, "CaptureEngine: staging_bytes", cfg.align)
    if staging_bytes > ring_bytes:
        raise ValueError(
            f"CaptureEngine: staging_bytes ({staging_bytes}) > ring_bytes ({ring_bytes}): "
            f"a transfer carries records from the ring, so staging beyond the ring's "
            f"size is never used; make the ring at least as large as staging"
        )
    return cfg, ring_bytes, staging_bytes


def resolve_controller(
    controller: GrantController | None,
    controller_config: ControllerConfig | None,
    staging_bytes: int,
) -> GrantController:
    """The caller's controller, if its grants fit in staging, else one over staging."""
    if controller is None:
        controller = GrantController(staging_bytes, controller_config)
    elif controller.staging_bytes > staging_bytes:
        raise ValueError(
            f"the controller grants up to {controller.staging_bytes} bytes but staging "
            f"has {staging_bytes}; build it with GrantController({staging_bytes}, ...)"
        )
    return controller


def event_factory(device: torch.device) -> Callable[[], Any] | None:
    """Readiness events for the record slots, created (and their CUDA events made) now."""
    if device.type != "cuda":
        return None
    stream = torch.cuda.current_stream(device)

    def make() -> torch.cuda.Event:
        ev = torch.cuda.Event()  # no timing: cheaper to record, and readiness is all we ask
        ev.record(stream)  # creates the CUDA event now rather than at the first capture
        return ev

    return make
