"""``syncless.monitors.attach``: set monitors up on a model (declare every metric,
allocate once, hook), and the :class:`~syncless.monitors.handle.MonitorHandle` that
flushes them per step."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from syncless.errors import UsageError
from syncless.metrics import MetricSet
from syncless.monitors.adapters import ModelMap, find_layers
from syncless.monitors.alarm import Action, check_action
from syncless.monitors.base import Monitor, MonitorContext, compiled_and_run
from syncless.monitors.budget import DEFAULT_BUDGET, Budget
from syncless.monitors.failures import Failures
from syncless.monitors.handle import MonitorHandle
from syncless.monitors.nonfinite import NonFiniteMonitor
from syncless.monitors.output_read import fuse_output_reads
from syncless.monitors.ranks import check_same_monitors, idle_on_every_rank
from syncless.recompute import recomputing
from syncless.run import Run

__all__ = ["attach"]


def attach(
    model: nn.Module | Sequence[nn.Module],
    monitors: Sequence[Monitor],
    *,
    run: Run | None = None,
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
    lagged: bool = True,
    layer_offsets: Sequence[int] | None = None,
    strict: bool = False,
    background: bool | None = None,
    budget: float | None = DEFAULT_BUDGET,
    on_nonfinite: Action = "warn",
    on_spike: Action = "warn",
) -> MonitorHandle:
    """Declare every monitor on every model chunk, allocate once, then attach hooks.

    ``model`` may be a list of chunks (interleaved pipeline parallel): all chunks are
    mapped and declared before the single allocate; ``layer_offsets`` gives each
    chunk's first global layer (see ``find_layers``), so ranks holding different
    stages declare different layers and the metric core allocates their union.
    ``lagged=True`` (default) reads a step's values at the next ``step()`` call, so no
    step waits for its own copy. ``background`` (default: on when the metrics live on a
    CUDA device and ``lagged``) decodes and derives each readout on a readout thread
    (see ``MonitorHandle``); on a CPU the step's records come back from the ``step``
    call that reads them, which is what tests and scripts expect.

    A monitor with nothing to watch in the model on every rank (``moe`` on a dense
    model) is left out with one line on rank 0 (``MonitorHandle.idle`` says why); bad
    input is a ``UsageError`` here (docs/monitors/README.md, "One monitor list for every
    model"). An exception inside syncless later, in a hook, ``step``, a readout, a
    derive or ``close``, is counted (``monitors/self/errors_count``) and reported once
    per place, not raised into the training step, unless ``strict=True``
    (syncless.monitors.failures).

    ``budget`` (default 0.01): the fraction of the step the stack may cost. Each
    monitor's host and device cost per active step is measured (lagged, no sync) and
    its cadence lengthened until the stack fits (a monitor's ``every`` is the fastest it
    runs); the cadences, costs and shares are recorded as ``monitors/self/*`` and
    printed at ``close()`` (syncless.monitors.budget). ``None``: fixed cadences. The
    nonfinite monitor is an alarm: its hooks check every step whatever the budget, and
    only its readout follows it.

    ``on_nonfinite``: what a readout that found a NaN or Inf does (nonfinite monitor):
    ``"warn"`` (default) prints one line naming the step, layer and count; ``"raise"``
    also raises :class:`~syncless.monitors.NonFiniteError` from the next ``step`` that
    follows the readout (lagged: never a sync to make it sooner); a callable is called
    with the :class:`~syncless.monitors.NonFiniteEvent` (syncless.monitors.alarm).

    ``on_spike``: the same for a spike of the loss or the gradient norm handed to
    ``handle.step`` (the nonfinite monitor's ``spikes`` rule, syncless.monitors.spikes):
    ``"raise"`` raises :class:`~syncless.monitors.SpikeError`, a callable gets the
    :class:`~syncless.monitors.SpikeEvent`.
    """
    if not monitors:
        raise ValueError("attach() needs at least one monitor")
    names = [m.name for m in monitors]
    if len(set(names)) != len(names):
        raise ValueError(f"each monitor may be attached once; got {names}")
    check_action(on_nonfinite)
    check_action(on_spike, "on_spike")
    for name, action in (("on_nonfinite", on_nonfinite), ("on_spike", on_spike)):
        if action != "warn" and not any(isinstance(m, NonFiniteMonitor) for m in monitors):
            raise UsageError(
                f"{name}={action!r} needs the nonfinite monitor: add "
                "monitors.NonFiniteMonitor() (or build([..., 'nonfinite']))"
            )
    check_same_monitors(monitors, group, budget)
    model_map = find_layers(model, layer_offsets=layer_offsets)
    if device is None:
        first = model[0] if isinstance(model, Sequence) else model
        device = next(first.parameters()).device
    roots = list(model) if isinstance(model, Sequence) else [model]
    if compiled_and_run(roots):
        message = (
            "attach() after the compiled model ran: torch.compile does not see hooks "
            "added to modules it already compiled (torch._dynamo.config."
            "skip_nnmodule_hook_guards is True), so some layers would record nothing. "
            "Attach before the first step, or set that option to False before compiling."
        )
        if strict:
            raise UsageError(message)
        print(f"syncless: warning: {message}", file=sys.stderr)
    idle = idle_on_every_rank(_nothing_to_watch(monitors, model_map), group)
    is_main = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if idle and is_main:
        print(_idle_line(idle, roots), file=sys.stderr)
    monitors = [m for m in monitors if m.name not in idle]
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
    failures = Failures(strict, rank)
    ctx = MonitorContext(model_map, MetricSet(group), roots, failures=failures)
    if budget is not None:
        always_on = [m.name for m in monitors if getattr(m, "always_on", False)]
        ctx.budget = Budget(
            budget, {m.name: m.every for m in monitors}, device, group, always_on=always_on
        )
    for m in monitors:
        with ctx.metrics.gated(m.name):  # its records follow its cadence on the device too
            m.prepare(ctx)
    ctx.metrics.allocate(device)
    owners: dict[int, str] = {}
    for m in monitors:
        first = len(ctx.handles)
        m.attach(ctx)
        owners.update((id(h), f"{m.name}_hook") for h in ctx.handles[first:])
    fuse_output_reads(ctx, monitors)
    if background is None:
        background = lagged and torch.device(device).type == "cuda"
    handle = MonitorHandle(
        monitors,
        ctx,
        run,
        lagged,
        emit=is_main,
        background=background,
        on_nonfinite=on_nonfinite,
        on_spike=on_spike,
    )
    handle.idle = idle
    if background and model_map.layers:
        hook = _backward_signal(handle)
        ctx.handles.append(model_map.layers[-1].block.register_forward_hook(hook))
        owners[id(ctx.handles[-1])] = "readout_signal_hook"
    # The adapters' hook code too, not only the monitors' callbacks (MonitorContext.timed).
    for h in ctx.handles:
        failures.guard_hook(h, owners.get(id(h), "output_hook"))
    return handle


def _nothing_to_watch(monitors: Sequence[Monitor], model_map: ModelMap) -> dict[str, str]:
    """Monitors that find nothing to watch in this rank's layers, and why."""
    idle = {}
    for m in monitors:
        check = getattr(m, "nothing_to_watch", None)  # optional for user monitors
        reason = check(model_map) if check is not None else None
        if reason:
            idle[m.name] = reason
    return idle


def _idle_line(idle: dict[str, str], roots: list[nn.Module]) -> str:
    model = "+".join(dict.fromkeys(type(r).__name__ for r in roots))
    if len(idle) == 1:
        ((name, why),) = idle.items()
        return (
            f"syncless: monitor {name} has nothing to watch in {model} ({why}) and "
            "records nothing (MonitorHandle.idle)"
        )
    found = "; ".join(f"{name}: {why}" for name, why in idle.items())
    return (
        f"syncless: monitors {', '.join(idle)} have nothing to watch in {model} ({found}) "
        "and record nothing (MonitorHandle.idle)"
    )


def _backward_signal(handle: MonitorHandle):
    """A forward hook on the last block: a gradient hook on its output tells the
    readout thread when the backward starts (one hook call and one tensor hook per
    forward)."""

    def hook(module: nn.Module, args: object, output: object) -> None:
        # A checkpoint's recompute runs inside the backward already (traced: not asked).
        if not torch.compiler.is_compiling() and recomputing():
            return
        # The output's Python type, not a tensor value: a structural branch.
        out = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(handle.backward_started)

    return hook
