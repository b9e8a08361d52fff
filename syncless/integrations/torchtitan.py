"""The monitors in torchtitan's ``Trainer`` (0.3): a ``MetricsProcessor`` that also runs
them.

From the job config, with no code (torchtitan's ``--override.imports`` swaps the
trainer's ``metrics`` component for this one and keeps its settings)::

    python -m torchtitan.train --module llama3 --config llama3_debugmodel \\
        --override.imports syncless.integrations.torchtitan.syncless_metrics
    # settings: 'syncless.integrations.torchtitan.syncless_metrics={"monitors": "attention,moe"}'

Or one line in a ``config_registry`` function::

    config.metrics = syncless_metrics(config.metrics, run_dir="runs/llama3")

Why the metrics processor: it is the one component the Trainer builds from its config
(so ``--override.imports`` reaches it), then hands ``model_parts`` and ``optimizers``
once AC, compile and FSDP are applied and the optimizer is built, and it is asked
``should_log(step)`` at the start of every step, before that step's forward, and
closed by ``Trainer.close()``. The monitors attach at the first ``should_log`` (the
hooks see the wrapped blocks, before the first compiled forward), each later call
flushes the step before it (after its optimizer step), and ``close`` flushes the last
step and closes the handle and the ``Run``. ``ModelSpec.post_optimizer_build_fn`` also
runs at the right moment, but it is a per-model callable (qwen3 MoE and deepseek_v3
already use it), has no per-step call and no end.

CUDA graphs (torchtitan's default on GPU) need nothing from the user. Step 1 runs
eagerly with the hooks attached just before it; step 2 is captured with them. From
then on each replay runs their kernels, and a device gate per monitor, set by the
flush in the next ``should_log`` (outside the graph), decides whether they record.

Every step's loss and gradient norm reach ``handle.step`` as device tensors (the
nonfinite alarm checks them): :class:`StepValues` says where they are taken from.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config.override import derive, override

from syncless.errors import UsageError
from syncless.integrations.session import MonitorSession
from syncless.monitors.budget import DEFAULT_BUDGET

__all__ = ["StepValues", "SynclessMetricsProcessor", "syncless_metrics"]

log = logging.getLogger(__name__)
# Frames between the optimizer's pre-step hook and Trainer.train_step (the optimizer's
# step wrappers); a few more for a subclass that wraps train_step.
_FRAMES_SEARCHED = 8


class StepValues:
    """The loss and gradient norm of the trainer's step in flight, on the device.

    torchtitan's ``train_step`` hands the metrics processor host floats, and only on
    log steps. Both values exist on the device at every step, inside ``train_step``:

    * the loss: ``forward_backward_step`` returns it, once per gradient-accumulation
      micro-batch. :meth:`install` puts a wrapper on the trainer instance (its
      ``forward_backward_step`` attribute, removed by :meth:`remove`) that adds each
      micro-batch's loss into a tensor of its own. Under CUDA graphs the returned loss
      is a static output of the graph, overwritten by the next replay; the wrapper
      runs outside the graph, right after the replay, so its copy is the step's.
    * the gradient norm: ``clip_grad_norm_``'s result, a local of ``train_step``. A
      pre-step hook on the trainer's optimizers reads it from that frame: nothing is
      computed again (a norm of our own would need the clipped-away gradients and,
      under FSDP or TP, a collective).

    Neither touches torchtitan's source or calls anything on its path. The cost per
    step: a clone (an add per further micro-batch), a count of the labels' valid
    tokens, and a multiply and a divide at the flush; no sync, no collective.

    ``loss`` is the rank's mean loss over its valid tokens, torchtitan's
    ``local_avg_loss`` (with one data-parallel rank, the loss it logs). A pipeline
    stage without the last layer has none.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.loss_sum: torch.Tensor | None = None
        self.tokens: torch.Tensor | None = None
        self.global_tokens: torch.Tensor | None = None
        self.grad_norm: torch.Tensor | None = None
        self._hook: Any = None
        self._missed = False

    def install(self) -> None:
        """Wrap the trainer's ``forward_backward_step``; hook its optimizers."""
        forward_backward = self.trainer.forward_backward_step

        def forward_backward_step(**kwargs: Any) -> torch.Tensor:
            loss = forward_backward(**kwargs)
            self.add_loss(loss, kwargs["labels"], kwargs["global_valid_tokens"])
            return loss

        self.trainer.forward_backward_step = forward_backward_step
        self._hook = self.trainer.optimizers.register_step_pre_hook(self._take_grad_norm)

    def remove(self) -> None:
        self.trainer.__dict__.pop("forward_backward_step", None)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @torch.no_grad()
    def add_loss(
        self, loss: torch.Tensor, labels: torch.Tensor | list[torch.Tensor], global_tokens: Any
    ) -> None:
        """One micro-batch's loss (its token sum over the global valid tokens)."""
        if not self._has_loss():
            return
        parts = labels if isinstance(labels, list) else [labels]
        tokens = sum((part != IGNORE_INDEX).sum() for part in parts)
        if self.loss_sum is None:
            self.loss_sum, self.tokens = loss.detach().clone(), tokens
        else:
            self.loss_sum.add_(loss.detach())
            self.tokens = self.tokens + tokens
        self.global_tokens = global_tokens

    def _has_loss(self) -> bool:
        dims = getattr(self.trainer, "parallel_dims", None)
        pipelined = dims is not None and dims.pp_enabled
        return not pipelined or bool(getattr(self.trainer, "pp_has_last_stage", True))

    def _take_grad_norm(self, optimizer: Any, args: tuple, kwargs: dict) -> None:
        frame = sys._getframe(1)
        for _ in range(_FRAMES_SEARCHED):
            if frame is None:
                break
            names = frame.f_locals
            if names.get("self") is self.trainer and "grad_norm" in names:
                self.grad_norm = names["grad_norm"]
                return
            frame = frame.f_back
        if not self._missed:
            self._missed = True
            log.warning(
                "syncless: the optimizer stepped outside torchtitan's train_step (no "
                "grad_norm local in its caller): the gradient norm is not checked"
            )

    def take(self) -> dict[str, torch.Tensor]:
        """The step's values for ``handle.step``, and a fresh start for the next."""
        out: dict[str, torch.Tensor] = {}
        if self.loss_sum is not None:
            assert self.tokens is not None
            with torch.no_grad():
                out["loss"] = self.loss_sum * self.global_tokens / self.tokens.clamp(min=1)
        if self.grad_norm is not None:
            out["grad_norm"] = self.grad_norm
        self.loss_sum = self.tokens = self.global_tokens = self.grad_norm = None
        return out


class SynclessMetricsProcessor(MetricsProcessor):
    """torchtitan's metrics (console, TensorBoard, wandb, unchanged) plus the syncless
    monitors on every model part, flushed once per optimizer step into a ``Run``.

    The records are labelled with torchtitan's step numbers (from 1). ``session``
    holds the run and the handle; after ``close`` the handle's counters and last
    readouts stay readable.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        monitors: str = "all"
        """Monitors to attach: "all" or a comma list (attention, moe, activations, ...)."""

        run_dir: str | None = None
        """The syncless run directory (default: runs/<time>-torchtitan)."""

        budget: float | None = DEFAULT_BUDGET
        """The share of the step the monitors may cost (None: fixed cadences)."""

        every: int | None = None
        """The fastest cadence in steps (default: each monitor's own)."""

    session: MonitorSession
    step_running: int | None
    step_values: StepValues | None

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        job = kwargs.get("config_dict") or {}
        self.session = MonitorSession(
            config.monitors,
            run_dir=config.run_dir,
            run_name="torchtitan",
            budget=config.budget,
            every=config.every,
        )
        self._job = job
        self.step_running = None
        self.step_values = None

    def should_log(self, step: int) -> bool:
        # The trainer asks once per step, before its forward: the place to attach (first
        # call) or to flush the step before, whose optimizer step has run. Under CUDA
        # graphs this is outside the captured forward and backward, between replays, as
        # handle.step must be; the flush also sets the gates the next replay reads.
        if self.session.handle is None:
            self._open()
        elif self.step_running is not None and step != self.step_running:
            self.session.handle.step(self.step_running, **self._checked_values())
        self.step_running = step
        return super().should_log(step)

    def close(self) -> None:
        try:
            handle = self.session.handle
            if handle is not None and self.step_running is not None:
                handle.step(self.step_running, **self._checked_values())
            if self.step_values is not None:
                self.step_values.remove()
            self.session.close()
        finally:
            super().close()

    def _checked_values(self) -> dict[str, torch.Tensor]:
        """The flushed step's loss and gradient norm, where the handle checks them."""
        if self.step_values is None:
            return {}
        values = self.step_values.take()
        handle = self.session.handle
        return values if handle is not None and handle.nonfinite is not None else {}

    def _open(self) -> None:
        parts = self.model_parts
        if not parts:
            raise UsageError(
                "SynclessMetricsProcessor: the trainer set no model_parts before the first "
                "step; torchtitan's Trainer sets them after building the optimizer"
            )
        # Pipeline stages: the adapter numbers their layers by torchtitan's layer ids.
        model = parts[0] if len(parts) == 1 else list(parts)
        self.session.open(model, self.optimizers, {"torchtitan": self._job})  # type: ignore[arg-type]
        trainer = calling_trainer(self)
        if trainer is None:
            log.warning(
                "syncless: SynclessMetricsProcessor.should_log was not called by a "
                "torchtitan Trainer's train_step: the loss and gradient norm are not checked"
            )
            return
        self.step_values = StepValues(trainer)
        self.step_values.install()


def calling_trainer(processor: MetricsProcessor) -> Any | None:
    """The trainer on the call stack whose ``metrics_processor`` is ``processor`` (the
    Trainer does not hand itself to its components); None when there is none."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if getattr(owner, "metrics_processor", None) is processor:
            return owner
        frame = frame.f_back
    return None


@override(
    target=MetricsProcessor.Config,
    description="syncless: sync-free training monitors beside torchtitan's metrics",
)
def syncless_metrics(config: MetricsProcessor.Config, **settings: Any) -> MetricsProcessor.Config:
    """``config`` (the trainer's ``metrics``) as a ``SynclessMetricsProcessor.Config``:
    its own settings kept, ``settings`` (monitors, run_dir, budget, every) added."""
    return derive(config, SynclessMetricsProcessor.Config, **settings)
