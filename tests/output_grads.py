"""Ground truth for the gradients monitor inside the stacks (issue #46): the gradient at
each block's output, kept by plain hooks, recounted in float64.

:class:`OutputGrads` keeps every forward's block output (``retain_grad``) and turns
their gradients into :class:`GradTotals` (sum of g^2, max |g|, NaN/Inf elements, element
count). Totals of ranks or micro-batches add up; :func:`assert_recorded` compares them
with what the monitor recorded. :func:`attach_guarded` and
:func:`guarded_gradient_callbacks` run the monitor's hooks under ``no_sync()`` where the
stack around them syncs by itself; :class:`StepLog` collects a spawned rank's steps.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from hook_guard import HookGuard
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from syncless.guard import no_sync
from syncless.monitors import MonitorHandle, attach
from syncless.monitors.adapters.sites import LayerSite


@dataclass(frozen=True)
class GradTotals:
    """One layer's gradients of a step: what the monitor reduces over ranks."""

    sq: float
    absmax: float
    nonfinite: int
    count: int

    def __add__(self, other: GradTotals) -> GradTotals:
        return GradTotals(
            self.sq + other.sq,
            max(self.absmax, other.absmax),
            self.nonfinite + other.nonfinite,
            self.count + other.count,
        )

    @classmethod
    def of(cls, grad: torch.Tensor) -> GradTotals:
        """``grad``'s totals; a DTensor's over the whole tensor (a collective: the test's)."""
        if isinstance(grad, DTensor):
            grad = grad.full_tensor()
        g = grad.detach().double()
        finite = torch.where(torch.isfinite(g), g, 0)  # the monitor's sum and max skip the rest
        return cls(
            float(finite.square().sum()),
            float(finite.abs().max()),
            int((~torch.isfinite(g)).sum()),
            g.numel(),
        )


def combine(parts: Iterable[Mapping[int, GradTotals]]) -> dict[int, GradTotals]:
    """Layer by layer, the totals of several ranks (or steps): a layer missing from a
    part adds nothing."""
    out: dict[int, GradTotals] = {}
    for part in parts:
        for layer, totals in part.items():
            out[layer] = out[layer] + totals if layer in out else totals
    return out


def _hidden(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


class OutputGrads:
    """Keeps the output of every forward of ``blocks`` (``{layer: block}``), its gradient
    retained; :meth:`take` recounts them once the backward has run."""

    def __init__(self, blocks: Mapping[int, nn.Module]) -> None:
        self.kept: dict[int, list[torch.Tensor]] = {layer: [] for layer in blocks}
        for layer, block in blocks.items():
            block.register_forward_hook(self._keeper(layer))

    def _keeper(self, layer: int) -> Callable[..., None]:
        def keep(module: nn.Module, args: Any, output: Any) -> None:
            hidden = _hidden(output)
            if hidden.requires_grad:
                hidden.retain_grad()  # runs after every other hook on the tensor
                self.kept[layer].append(hidden)

        return keep

    def take(self) -> dict[int, GradTotals]:
        """Each layer's totals over the forwards since the last call (a step's
        micro-batches); the kept outputs are dropped.

        An output the backward never reached has no gradient and adds nothing: a
        checkpointed forward's, where the model enables grad inside it (Megatron's
        bias-dropout-add) and the recompute's copy is the one the backward walks. The
        tests check the element counts, so a micro-batch missed here would show."""
        out = {}
        for layer, outputs in self.kept.items():
            grads = [{layer: GradTotals.of(h.grad)} for h in outputs if h.grad is not None]
            out.update(combine(grads))
            outputs.clear()
        return out


def plant_inf(block: nn.Module, armed: Callable[[], bool]) -> None:
    """The first element of ``block``'s output gradient becomes +inf while ``armed()``
    (a tensor hook that replaces the gradient; registered before the monitor's, it runs
    first, so the monitor and ``OutputGrads`` both see it). Of a DTensor gradient, the
    first element of the whole tensor: one rank's shard holds it, or every replica."""

    def poison(grad: torch.Tensor) -> torch.Tensor:
        bump = torch.zeros(grad.shape, dtype=grad.dtype)
        bump.view(-1)[0] = math.inf
        if isinstance(grad, DTensor):  # each rank slices its own part: no collective
            mesh, placements = grad.device_mesh, grad.placements
            return grad + distribute_tensor(bump, mesh, placements, src_data_rank=None)
        return grad + bump

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        hidden = _hidden(output)
        if armed() and hidden.requires_grad:
            hidden.register_hook(poison)

    block.register_forward_hook(hook)


def assert_recorded(records: Mapping[str, float], truth: Mapping[int, GradTotals]) -> None:
    """``records`` (one step's, name -> value) hold, for every layer of ``truth``, the
    RMS, max |g| and NaN/Inf count of its totals, and no layer beside them; the monitor
    counted no error of its own."""
    for layer, want in truth.items():
        scope = f"monitors/layer_{layer:02d}"
        rms = math.sqrt(want.sq / want.count)
        assert math.isclose(records[f"{scope}/grad_out_rms"], rms, rel_tol=1e-5), layer
        absmax = records[f"{scope}/grad_out_absmax"]
        assert math.isclose(absmax, want.absmax, rel_tol=1e-6), layer
        assert records[f"{scope}/grad_out_nonfinite_count"] == want.nonfinite, layer
    recorded = {name.split("/")[1] for name in records if name.endswith("/grad_out_rms")}
    assert recorded == {f"layer_{layer:02d}" for layer in truth}
    assert records["monitors/self/errors_count"] == 0


class Guarded(NamedTuple):
    """What :func:`attach_guarded` returns: the handle, and the monitor's hooks that ran
    under ``no_sync()`` (its forward hooks in ``forward.calls``, its gradient callbacks
    in ``backward[0]``)."""

    handle: MonitorHandle
    forward: HookGuard
    backward: list[int]


@contextlib.contextmanager
def guarded_gradient_callbacks() -> Iterator[list[int]]:
    """While open, every callback an attach hands ``LayerSite.attach_output_grad`` runs
    under ``no_sync(cpu_as_device=True)`` in the backward; yields the count of their
    calls (``[n]``). A sync in a callback raises ``SyncError``, which the monitor counts
    (``monitors/self/errors_count``)."""
    calls = [0]
    attach_output_grad = LayerSite.attach_output_grad

    def attach_output_grad_guarded(site: LayerSite, callback: Callable[..., None]) -> list:
        def guarded(grad: torch.Tensor) -> None:
            calls[0] += 1
            with no_sync(cpu_as_device=True):
                callback(grad)

        return attach_output_grad(site, guarded)

    LayerSite.attach_output_grad = attach_output_grad_guarded  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        LayerSite.attach_output_grad = attach_output_grad  # type: ignore[method-assign]


def attach_guarded(
    model: nn.Module | Sequence[nn.Module], monitors: Sequence[Any], **kwargs: Any
) -> Guarded:
    """``attach(model, monitors, **kwargs)`` with every hook it adds run under
    ``no_sync(cpu_as_device=True)``: its forward hooks (tests/hook_guard.py) and the
    gradient callbacks they register. For stacks whose own forward or schedule syncs,
    where a test cannot guard the whole step."""
    forward = HookGuard()
    chunks = nn.ModuleList([model] if isinstance(model, nn.Module) else model)
    forward.snapshot(chunks)
    with guarded_gradient_callbacks() as backward:
        handle = attach(model, monitors, **kwargs)
    forward.guard(chunks)
    return Guarded(handle, forward, backward)


class StepLog:
    """A rank's steps for the parent process: each step's records (flushed under
    ``no_sync()``) beside its truth, and the guarded hooks' calls."""

    def __init__(self, guarded: Guarded, truth: OutputGrads) -> None:
        self.guarded, self.truth = guarded, truth
        self.records: list[dict[str, float]] = []
        self.truths: list[dict[int, GradTotals]] = []

    def end_step(self, step: int) -> None:
        with no_sync(cpu_as_device=True):
            records = self.guarded.handle.step(step)
        self.records.append({r.name: r.value for r in records})
        self.truths.append(self.truth.take())

    def close(self) -> dict[str, Any]:
        """Closes the handle; what the rank returns: ``records`` and ``truth`` by step,
        ``calls`` (forward hooks, gradient callbacks)."""
        self.guarded.handle.close()
        calls = (self.guarded.forward.calls, self.guarded.backward[0])
        return {"records": self.records, "truth": self.truths, "calls": calls}
