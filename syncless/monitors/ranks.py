"""What every rank's monitors must agree on before anything is declared."""

from __future__ import annotations

from collections.abc import Sequence

import torch.distributed as dist

from syncless.errors import UsageError
from syncless.monitors.base import Monitor


def check_same_monitors(
    monitors: Sequence[Monitor], group: dist.ProcessGroup | None, budget: float | None
) -> None:
    """Every rank must attach the same monitors with the same cadences and budget
    (pipeline stages may hold other layers, not other monitors): otherwise one clear
    error on every rank, not a union of keys rank 0 never asked for (cold path, once)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return
    mine = (sorted((m.name, m.every) for m in monitors), budget)
    everyone: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    if any(theirs != everyone[0] for theirs in everyone):
        detail = "; ".join(
            f"rank {r}: {', '.join(f'{n} every {e}' for n, e in monitors_)}, budget {b}"
            for r, (monitors_, b) in enumerate(everyone)  # type: ignore[misc]
        )
        raise UsageError(
            f"attach(): the ranks attached different monitors ({detail}); every rank "
            "must attach the same monitors with the same every= and budget= (pipeline "
            "stages differ in their layers, which layer_offsets gives, not in monitors)"
        )


def idle_on_every_rank(idle: dict[str, str], group: dist.ProcessGroup | None) -> dict[str, str]:
    """The monitors with nothing to watch on every rank (``idle``: this rank's, with
    the reason). A monitor that finds something on any rank stays on all of them:
    pipeline stages hold different layers (a dense first stage, MoE stages after it),
    and every rank must flush the same monitors (cold path, once)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) < 2:
        return idle
    everyone: list[object] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, sorted(idle), group=group)
    return {
        name: why
        for name, why in idle.items()
        if all(name in theirs for theirs in everyone)  # type: ignore[operator]
    }
