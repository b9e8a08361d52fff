"""Built-in monitors by name: ``build("all")``, ``build("attention,moe")``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from syncless.errors import UsageError
from syncless.monitors.base import Monitor

MONITORS = ("attention", "moe", "activations", "nonfinite", "norms", "gradients")


def parse_names(names: str | Sequence[str]) -> list[str]:
    """``"all"`` or a comma-separated list (or a sequence) of built-in monitor names."""
    items = names.split(",") if isinstance(names, str) else list(names)
    items = [n.strip() for n in items if n.strip()]
    if items == ["all"]:
        return list(MONITORS)
    unknown = [n for n in items if n not in MONITORS]
    if unknown or not items:
        raise UsageError(
            f"unknown monitor(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
            f"valid: all, or a comma list of {', '.join(MONITORS)}"
        )
    return list(dict.fromkeys(items))


def build(
    names: str | Sequence[str],
    *,
    optimizer: torch.optim.Optimizer | None = None,
    every: int | None = None,
    is_sharded: Callable[[str], bool] | None = None,
) -> list[Monitor]:
    """Instantiate built-in monitors with their default cadences (or ``every``)."""
    from syncless.monitors.activations import ActivationsMonitor
    from syncless.monitors.attention import AttentionMonitor
    from syncless.monitors.gradients import GradientsMonitor
    from syncless.monitors.moe import MoEMonitor
    from syncless.monitors.nonfinite import NonFiniteMonitor
    from syncless.monitors.norms import NormsMonitor

    cadence = {} if every is None else {"every": every}
    out: list[Monitor] = []
    for name in parse_names(names):
        if name == "attention":
            out.append(AttentionMonitor(**cadence))
        elif name == "moe":
            out.append(MoEMonitor(**cadence))
        elif name == "activations":
            out.append(ActivationsMonitor(**cadence))
        elif name == "nonfinite":
            out.append(NonFiniteMonitor(**cadence))
        elif name == "gradients":
            out.append(GradientsMonitor(**cadence))
        elif name == "norms":
            if optimizer is None:
                raise UsageError(
                    "the norms monitor needs the optimizer (build(..., optimizer=opt))"
                )
            out.append(NormsMonitor(optimizer, is_sharded=is_sharded, **cadence))
    return out
