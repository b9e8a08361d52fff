"""The monitors in a Hugging Face ``Trainer``: a ``TrainerCallback``.

```python
from syncless.integrations.transformers import SynclessCallback

trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[SynclessCallback()])
trainer.train()  # the run directory: callback.run.dir
```

At train begin it unwraps what Accelerate wrapped (the model's ``module``, the
``AcceleratedOptimizer``'s ``optimizer``: the real optimizer is the one whose step the
norms monitor hooks), opens a ``Run`` and attaches the monitors with their overhead
budget; at each step end, after the optimizer step, it flushes once (the Trainer calls
``on_step_end`` once per optimizer step, after all gradient-accumulation micro-batches,
whose values join the step's); at train end it closes both.

Definitions differ from the Trainer's own logs: ``monitors/global/grad_norm`` is the
norm of the decoder layers' gradients *after* the Trainer's clipping (the norms monitor
reads them in the optimizer's pre-step hook), while the Trainer logs ``grad_norm``,
the norm of every gradient (embeddings and head included) *before* clipping.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import TrainerCallback

from syncless.monitors import MonitorHandle, attach, build, parse_names
from syncless.monitors.budget import DEFAULT_BUDGET
from syncless.run import Run


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model under DDP / Accelerate / torch.compile wrappers (``module``,
    ``_orig_mod``)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer under Accelerate's ``AcceleratedOptimizer`` (``optimizer``).

    The wrapper subclasses ``torch.optim.Optimizer`` without its hook tables, so it is
    unwrapped by attribute, not by type."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


class SynclessCallback(TrainerCallback):
    """``monitors``: ``"all"`` or a comma list (``syncless.monitors.build``);
    ``run_dir``: the run directory (default ``runs/<time>-<run_name>``); ``budget``:
    the share of the step the monitors may cost (``None``: fixed cadences);
    ``every``: the fastest cadence (default: each monitor's own)."""

    def __init__(
        self,
        monitors: str = "all",
        run_dir: str | None = None,
        run_name: str = "hf-trainer",
        budget: float | None = DEFAULT_BUDGET,
        every: int | None = None,
    ) -> None:
        self.monitors = parse_names(monitors)  # a clear error now, not at train begin
        self.run_dir = run_dir
        self.run_name = run_name
        self.budget = budget
        self.every = every
        self.run: Run | None = None
        self.handle: MonitorHandle | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        model = unwrap_model(model)
        real_optimizer = unwrap_optimizer(optimizer)
        names = self.monitors
        if "norms" in names and real_optimizer is None:
            raise RuntimeError(
                "SynclessCallback: the norms monitor needs the optimizer, and the Trainer "
                "passed none to on_train_begin; leave norms out of monitors="
            )
        config = {"trainer": {k: str(v) for k, v in args.to_dict().items()}}
        self.run = Run(name=self.run_name, run_dir=self.run_dir, config=config)
        built = build(names, optimizer=real_optimizer, every=self.every)
        self.handle = attach(model, built, run=self.run, budget=self.budget)

    def on_step_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.step(state.global_step - 1)  # global_step counts finished steps

    def on_train_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.close()  # kept: its counters and last readouts stay readable
        if self.run is not None:
            self.run.close()
