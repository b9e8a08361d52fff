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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torchtitan.components.metrics import MetricsProcessor
from torchtitan.config.override import derive, override

from syncless.errors import UsageError
from syncless.integrations.session import MonitorSession
from syncless.monitors.budget import DEFAULT_BUDGET

__all__ = ["SynclessMetricsProcessor", "syncless_metrics"]


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

    def should_log(self, step: int) -> bool:
        # The trainer asks once per step, before its forward: the place to attach (first
        # call) or to flush the step before, whose optimizer step has run. Under CUDA
        # graphs this is outside the captured forward and backward, between replays, as
        # handle.step must be; the flush also sets the gates the next replay reads.
        if self.session.handle is None:
            self._open()
        elif self.step_running is not None and step != self.step_running:
            self.session.handle.step(self.step_running)
        self.step_running = step
        return super().should_log(step)

    def close(self) -> None:
        try:
            handle = self.session.handle
            if handle is not None and self.step_running is not None:
                handle.step(self.step_running)
            self.session.close()
        finally:
            super().close()

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


@override(
    target=MetricsProcessor.Config,
    description="syncless: sync-free training monitors beside torchtitan's metrics",
)
def syncless_metrics(config: MetricsProcessor.Config, **settings: Any) -> MetricsProcessor.Config:
    """``config`` (the trainer's ``metrics``) as a ``SynclessMetricsProcessor.Config``:
    its own settings kept, ``settings`` (monitors, run_dir, budget, every) added."""
    return derive(config, SynclessMetricsProcessor.Config, **settings)
