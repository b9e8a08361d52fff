"""syncless in Megatron-core's training loop: monitors on the model chunks, profiler
sections over the pipeline schedule, capture windows between pipeline communications.

```python
from megatron.core.pipeline_parallel import get_forward_backward_func
from syncless.integrations.megatron import SynclessMegatron

observer = SynclessMegatron(model_chunks, optimizer, profiler=prof, capture=engine)
forward_backward = observer.forward_backward(get_forward_backward_func())
for iteration in range(iterations):
    losses = forward_backward(forward_step_func=..., model=model_chunks, ...)
    observer.optimizer_step(optimizer)  # optimizer.step() in a profiler section
    observer.step(iteration)
observer.close()
```

Megatron's extension point is the model config's ``timers``: its schedules and
``P2PCommunicator`` call ``config.timers(name).start()`` / ``.stop()`` around every
forward and backward compute and every pipeline send and receive. ``SynclessMegatron``
installs :class:`ScheduleTimers` there, which forwards each call to the timers that were
there before (Megatron-LM's own keep logging) and

- opens and closes a profiler section of the same name (``forward-compute``,
  ``backward-recv``, ...: the pipeline's communications are ``collective`` sections);
- publishes a capture boundary at the start and the end of each pipeline
  communication, so the D2H windows are the compute between two communications.

The data-parallel gradient reduce (``config.finalize_model_grads_func``) is timed by
``Profiler.collective``, with its rendezvous/transfer split. Forward-only calls
(validation) pause the monitors and suspend the capture engine: no window is published,
nothing they flush counts against the training windows, and both resume after.

CUDA graphs: one per iteration (``cuda_graph_scope="full_iteration"``, Megatron's
``FullCudaGraphWrapper`` passed to ``forward_backward``) captures the monitors' hooks
with the schedule. Megatron's per-layer graphs are refused at construction
(``check_cuda_graphs`` in the Megatron adapter says why).

Each iteration's loss and gradient norm reach ``handle.step`` as device tensors (the
nonfinite alarm checks them): the loss reduced over the micro-batches from what the
schedule returns, the norm from what Megatron's ``optimizer.step()`` returns
(:func:`reduced_loss`, :meth:`SynclessMegatron.optimizer_step`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from syncless.errors import UsageError
from syncless.integrations.session import unwrap_optimizer
from syncless.monitors import MonitorHandle, attach, build, parse_names
from syncless.monitors.adapters.megatron import (
    check_cuda_graphs,
    find_gpt,
    graphs_per_iteration,
    param_layout,
)
from syncless.monitors.budget import DEFAULT_BUDGET
from syncless.monitors.norms import NormsMonitor
from syncless.monitors.norms_sharding import REPLICATED, Layout
from syncless.run import Run, StepRecords

log = logging.getLogger(__name__)

# Megatron's timer names for pipeline communications all end in -send or -recv.
_COMMUNICATION_SUFFIXES = ("-send", "-recv")
# The loss Megatron-LM's pretrain_gpt reports (its loss_func's dict key).
LM_LOSS = "lm loss"


def is_communication(name: str) -> bool:
    """Whether Megatron's timer ``name`` times a pipeline send or receive."""
    return name.endswith(_COMMUNICATION_SUFFIXES)


class _Timer:
    """One named timer: the previous timers' and the profiler section, side by side."""

    __slots__ = ("inner", "name", "owner")

    def __init__(self, owner: ScheduleTimers, name: str, inner: Any) -> None:
        self.owner, self.name, self.inner = owner, name, inner

    def start(self, barrier: bool = False) -> None:
        if self.inner is not None:
            self.inner.start(barrier=barrier)
        self.owner.started(self.name)

    def stop(self, barrier: bool = False) -> None:
        self.owner.stopped(self.name)
        if self.inner is not None:
            self.inner.stop(barrier=barrier)

    def __getattr__(self, attribute: str) -> Any:  # elapsed(), reset(), ... of the inner
        return getattr(self.inner, attribute)


class ScheduleTimers:
    """A stand-in for Megatron's ``Timers`` on ``config.timers``.

    ``inner``: the timers it replaces (``None``: Megatron's default). ``profiler``: a
    ``syncless.profile.Profiler`` (its sections need an open step). ``capture``: a
    ``syncless.capture.CaptureEngine`` whose boundaries the communications publish.
    """

    def __init__(self, inner: Any = None, profiler: Any = None, capture: Any = None) -> None:
        self.inner, self.profiler, self.capture = inner, profiler, capture
        # Inside a training iteration: sections and boundaries only then (a validation
        # pass has no profiler step open, and publishes no windows).
        self.training = False
        self.boundaries = 0  # communication edges this iteration (the pattern's period)

    def __call__(self, name: str, log_level: int | None = None, barrier: bool = False) -> _Timer:
        inner = None
        if self.inner is not None:
            inner = self.inner(name, log_level=log_level, barrier=barrier)
        return _Timer(self, name, inner)

    def started(self, name: str) -> None:
        if not self.training:
            return
        if self.profiler is not None:
            category = "collective" if is_communication(name) else "compute"
            self.profiler.begin_section(name, category=category)
        if is_communication(name):
            self._boundary()

    def stopped(self, name: str) -> None:
        if not self.training:
            return
        if is_communication(name):
            self._boundary()
        if self.profiler is not None:
            self.profiler.end_section(name)

    def _boundary(self) -> None:
        self.boundaries += 1
        if self.capture is not None and self.capture.controller.pattern is not None:
            self.capture.advance_boundary()

    def __getattr__(self, attribute: str) -> Any:  # log(), write(), ... of the inner
        if self.inner is None:
            raise AttributeError(attribute)
        return getattr(self.inner, attribute)


def communication_windows(boundaries: int) -> Any:
    """The windows of an iteration with ``boundaries`` communication edges (a start and
    a stop each): from each communication's end to the next one's start, the last one
    reaching the next iteration's first."""
    from syncless.capture import WindowPattern

    if boundaries < 2 or boundaries % 2:
        raise UsageError(
            f"a pipeline iteration published {boundaries} communication boundaries; "
            "expected a start and a stop per send or receive (an even number >= 2)"
        )
    return WindowPattern(boundaries, [(b, b + 1) for b in range(1, boundaries, 2)])


def _check_windows_without_replays(config: Any) -> None:
    """Capture windows need the schedule's Python at every iteration: refused under
    pipeline parallelism with one CUDA graph per iteration."""
    if getattr(config, "pipeline_model_parallel_size", 1) > 1:
        raise UsageError(
            "SynclessMegatron(capture=...) with cuda_graph_scope='full_iteration' and "
            "pipeline parallelism: the capture windows follow the pipeline's sends and "
            "receives through config.timers, which a replayed iteration does not call. "
            "Pass capture=None, or cuda_graph_impl='none'"
        )


def model_config(chunks: Sequence[nn.Module]) -> Any:
    """The ``TransformerConfig`` of the first chunk, under ``.module`` wrappers."""
    gpt = find_gpt(chunks[0])
    if gpt is None or not hasattr(gpt.config, "timers"):
        raise UsageError(
            f"no Megatron-core GPTModel with a TransformerConfig in "
            f"{type(chunks[0]).__name__} or the modules it wraps: pass the model chunks "
            "Megatron's get_model returns"
        )
    return gpt.config


def norms_optimizer(
    optimizer: Any, chunks: Sequence[nn.Module]
) -> tuple[torch.optim.Optimizer, dict[int, tuple[nn.Parameter, Layout]]]:
    """The torch optimizer under Megatron's, and the copies of parameters it steps.

    Megatron's ``FP32Optimizer`` steps the model's own parameters. Its
    ``Float16OptimizerWithFloat16Params`` steps fp32 copies of them, and its
    ``DistributedOptimizer`` fp32 shards of them, each data-parallel rank its own slice
    (``model_float16_groups`` / ``shard_fp32_from_float16_groups`` and ``model_fp32_groups``
    / ``shard_fp32_groups``, pairwise, in megatron-core 0.16). The norms monitor reads
    the copies and counts each in its parameter's layer: a shard is summed over the
    ranks, divided by the tensor-parallel ranks that hold the same slice (a weight
    Megatron does not split by tensor parallelism)."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:  # get_megatron_optimizer always chains, one or more
        if len(chained) != 1:
            raise UsageError(
                f"Megatron's ChainedOptimizer holds {len(chained)} optimizers (a dense "
                "and an expert one, under the distributed optimizer with MoE); the norms "
                "monitor hooks one. Leave norms out (monitors='attention,moe,activations,"
                "nonfinite'), or attach a NormsMonitor to one of its chained_optimizers"
            )
        optimizer = chained[0]
    inner = unwrap_optimizer(optimizer)
    if inner is None:
        raise UsageError(
            f"{type(optimizer).__name__} holds no torch.optim.Optimizer (.optimizer) for "
            "the norms monitor to hook"
        )
    copies = main_param_copies(optimizer)
    mine = {id(p) for chunk in chunks for p in chunk.parameters()}
    stray = [
        p for group in inner.param_groups for p in group["params"]
        if id(p) not in mine and id(p) not in copies
    ]  # fmt: skip
    if stray:
        raise UsageError(
            f"{type(optimizer).__name__} steps {len(stray)} tensors that are neither the "
            "model's parameters nor Megatron's main copies of them: the norms monitor "
            "cannot map them to layers. Pass the optimizer Megatron built for these chunks"
        )
    return inner, copies


def main_param_copies(optimizer: Any) -> dict[int, tuple[nn.Parameter, Layout]]:
    """``id(copy) -> (model parameter, the copy's Layout)`` of a Megatron optimizer."""

    def pairs(models: str, copies: str) -> list[tuple[nn.Parameter, torch.Tensor]]:
        model_groups, copy_groups = getattr(optimizer, models), getattr(optimizer, copies)
        return [
            (m, c)
            for mg, cg in zip(model_groups, copy_groups, strict=True)
            for m, c in zip(mg, cg, strict=True)
            if c is not None
        ]

    out: dict[int, tuple[nn.Parameter, Layout]] = {}
    if hasattr(optimizer, "shard_fp32_from_float16_groups"):  # DistributedOptimizer
        for model_param, shard in pairs(
            "model_float16_groups", "shard_fp32_from_float16_groups"
        ) + pairs("model_fp32_groups", "shard_fp32_groups"):
            out[id(shard)] = (model_param, Layout(True, _shard_replicas(model_param)))
    elif hasattr(optimizer, "fp32_from_float16_groups"):  # Float16OptimizerWithFloat16Params
        for model_param, copy in pairs("float16_groups", "fp32_from_float16_groups"):
            out[id(copy)] = (model_param, param_layout(model_param) or REPLICATED)
    return out


def _shard_replicas(model_param: nn.Parameter) -> int:
    """Ranks holding the same distributed-optimizer shard of ``model_param``: the
    tensor-parallel ranks when Megatron does not split it by tensor parallelism (norms,
    routers); each slice is otherwise on one rank of its stage."""
    from megatron.core import parallel_state

    if getattr(model_param, "allreduce", True) is False:  # experts: (etp, ep, edp) mesh
        return 1
    if getattr(model_param, "tensor_model_parallel", False):
        return 1
    return parallel_state.get_tensor_model_parallel_world_size()


def reduced_loss(losses: Sequence[Any], key: str | None = None) -> torch.Tensor | None:
    """The iteration's loss from what the schedule returned, reduced on the device.

    ``losses``: one dict per micro-batch, what ``loss_func`` returned last
    (``forward_backward_func``'s result on the last pipeline stage; empty elsewhere).
    The value under ``key`` (default: ``"lm loss"``, else the dicts' only key) is
    reduced as Megatron-LM's ``train_step`` does: a ``[sum, tokens]`` pair per
    micro-batch gives the sum over the tokens, a scalar the mean over micro-batches.
    This rank's loss: Megatron-LM also averages the pair over data-parallel ranks,
    a collective left out here. None when there is no tensor to reduce (a Python
    number was read back already).
    """
    dicts = [d for d in losses if isinstance(d, dict)]
    if not dicts:
        return None
    if key is None:
        key = LM_LOSS if LM_LOSS in dicts[0] or len(dicts[0]) != 1 else next(iter(dicts[0]))
    values = [d.get(key) for d in dicts]
    if not all(isinstance(v, torch.Tensor) for v in values):
        return None
    with torch.no_grad():
        rows = torch.stack([v.detach().reshape(-1).float() for v in values])
        if rows.shape[1] == 2:
            total = rows.sum(dim=0)
            return total[0] / total[1].clamp(min=1)
        return rows.mean()


class SynclessMegatron:
    """The monitors, a profiler and a capture engine in a Megatron-core loop.

    Args:
        model: the model chunks (a list under virtual pipeline parallelism), as
            ``get_model`` returns them, wrappers included.
        optimizer: a torch optimizer, or Megatron's (``FP32Optimizer``,
            ``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``): the norms
            read what it steps (docs/integrations.md).
        monitors: ``"all"`` or a comma list (``syncless.monitors.build``).
        run: the run to record into (default: a new ``Run`` named ``megatron``).
        budget: the share of the step the monitors may cost (``None``: fixed cadences).
        profiler: a ``syncless.profile.Profiler``; ``step()`` closes its step.
        capture: a ``syncless.capture.CaptureEngine``; its window pattern is learnt
            from the first training iteration's pipeline communications.
        loss_key: the key of the loss in the dicts ``loss_func`` returns (default:
            ``"lm loss"``, else their only key); see :func:`reduced_loss`.
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        optimizer: Any = None,
        *,
        monitors: str = "all",
        run: Run | None = None,
        budget: float | None = DEFAULT_BUDGET,
        profiler: Any = None,
        capture: Any = None,
        loss_key: str | None = None,
    ) -> None:
        self.chunks = list(model) if isinstance(model, Sequence) else [model]
        self.config = model_config(self.chunks)
        check_cuda_graphs(self.config)  # before anything is opened or installed
        if capture is not None and graphs_per_iteration(self.config):
            _check_windows_without_replays(self.config)
        self.run = run if run is not None else Run(name="megatron")
        self._owns_run = run is None
        self.profiler, self.capture = profiler, capture
        built = self._monitors(parse_names(monitors), optimizer)
        self.handle: MonitorHandle = attach(self.chunks, built, run=self.run, budget=budget)
        self.timers = ScheduleTimers(self.config.timers, profiler, capture)
        self.config.timers = self.timers
        self._finalize = self.config.finalize_model_grads_func
        if profiler is not None and self._finalize is not None:
            self.config.finalize_model_grads_func = self._timed_finalize
        self.iterations = 0
        self.validations = 0
        self._step_open = False  # a profiler step this object began
        # This iteration's loss and gradient norm, device tensors for handle.step.
        self.loss_key = loss_key
        self.loss: torch.Tensor | None = None
        self.grad_norm: torch.Tensor | None = None
        self._no_loss_told = False

    def _monitors(self, names: list[str], optimizer: Any) -> list[Any]:
        if "norms" not in names:
            return build(names)
        if optimizer is None:
            raise UsageError("the norms monitor needs the optimizer: SynclessMegatron(model, opt)")
        inner, copies = norms_optimizer(optimizer, self.chunks)
        norms = NormsMonitor(inner, main_params=copies)
        rest = [n for n in names if n != "norms"]
        others = iter(build(rest) if rest else [])
        return [norms if n == "norms" else next(others) for n in names]

    def _timed_finalize(self, *args: Any, **kwargs: Any) -> Any:
        return self.profiler.collective("dp-grads-reduce", self._finalize, *args, **kwargs)

    def forward_backward(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` (``get_forward_backward_func()``, or Megatron's
        ``FullCudaGraphWrapper`` of it) with validation suspended and the window pattern
        learnt at the first training iteration."""
        if getattr(function, "cuda_graph_warmup_steps", 1) < 1:
            raise UsageError(
                "FullCudaGraphWrapper(..., cuda_graph_warmup_steps=0) captures the first "
                "iteration. A monitor's Triton kernel is loaded onto the GPU at its first "
                "launch, which a capture refuses: leave at least one eager iteration"
            )

        def forward_backward(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("forward_only", False):
                return self._validate(function, args, kwargs)
            return self._train(function, args, kwargs)

        return forward_backward

    def _train(self, function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self.profiler is not None and not self._step_open:
            self.profiler.begin_step(self.iterations)
            self._step_open = True
        self.timers.training = True
        self.timers.boundaries = 0
        try:
            losses = function(*args, **kwargs)
        finally:
            self.timers.training = False
            first = self.iterations == 0
            self.iterations += 1
            if first and self.capture is not None and self.timers.boundaries:
                self.capture.define_pattern(communication_windows(self.timers.boundaries))
        # Reduced now, into a tensor of its own: under FullCudaGraphWrapper the dicts
        # hold the graph's static outputs, which the next replay overwrites.
        self.loss = reduced_loss(losses or [], self.loss_key)
        if self.loss is None and losses and not self._no_loss_told:
            self._no_loss_told = True
            log.warning(
                "syncless: no loss tensor under key %r in what loss_func returned "
                "(keys: %s): pass SynclessMegatron(loss_key=...), or step(loss=...)",
                self.loss_key or LM_LOSS,
                sorted(losses[0]) if isinstance(losses[0], dict) else type(losses[0]).__name__,
            )
        return losses

    def _validate(self, function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self.validations += 1
        self.handle.pause()
        if self.capture is not None:
            self.capture.suspend()
        try:
            return function(*args, **kwargs)
        finally:
            if self.capture is not None:
                self.capture.resume()
            self.handle.resume()

    def optimizer_step(self, optimizer: Any) -> Any:
        """``optimizer.step()`` in an ``optimizer`` profiler section; its result.

        A Megatron optimizer returns ``(success, grad_norm, zeros)``; the norm is the
        total norm before clipping, which Megatron has already read to the host
        (``get_grad_norm_fp32`` ends in ``.item()``). It goes back to the device as a
        fill, a kernel argument: no copy, no sync. A skipped step (an fp16 overflow)
        has no norm. A torch optimizer returns none: pass ``step(grad_norm=...)``.
        """
        if self.profiler is None:
            result = optimizer.step()
        else:
            with self.profiler.section("optimizer"):
                result = optimizer.step()
        self.grad_norm = self._device_norm(result)
        return result

    def _device_norm(self, result: Any) -> torch.Tensor | None:
        if not (isinstance(result, tuple) and len(result) == 3):
            return None
        norm = result[1]
        if isinstance(norm, torch.Tensor):
            return norm
        if not isinstance(norm, int | float):
            return None
        device = next(self.chunks[0].parameters()).device
        return torch.full((), float(norm), dtype=torch.float32, device=device)

    def step(
        self,
        iteration: int,
        *,
        loss: torch.Tensor | None = None,
        grad_norm: torch.Tensor | None = None,
    ) -> StepRecords:
        """Once per training iteration, after the optimizer step; the monitors' records
        read back by this call (``MonitorHandle.step``).

        ``loss``/``grad_norm``: device tensors in place of what this object took from
        the schedule's result and ``optimizer_step`` (with a torch optimizer, the
        result of your ``clip_grad_norm_``). The nonfinite alarm checks both."""
        if self._step_open:
            self.profiler.end_step()
            self._step_open = False
        values = {
            "loss": loss if loss is not None else self.loss,
            "grad_norm": grad_norm if grad_norm is not None else self.grad_norm,
        }
        self.loss = self.grad_norm = None
        if self.handle.nonfinite is None:
            return self.handle.step(iteration)
        return self.handle.step(iteration, **{k: v for k, v in values.items() if v is not None})

    def close(self) -> None:
        """Close the handle and put Megatron's timers back (and the run, if ours)."""
        self.handle.close()
        self.config.timers = self.timers.inner
        if self._finalize is not None:
            self.config.finalize_model_grads_func = self._finalize
        if self._owns_run:
            self.run.close()
