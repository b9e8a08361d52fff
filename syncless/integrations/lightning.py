"""The monitors in a Lightning ``Trainer``: a ``lightning.pytorch`` callback.

```python
from syncless.integrations.lightning import SynclessCallback

trainer = lightning.Trainer(max_steps=1000, callbacks=[SynclessCallback()])
trainer.fit(module, data)  # the run directory: callback.run.dir
```

At fit start it finds the model the adapters know inside the ``LightningModule``
(the module itself, else its first child that maps: a Hugging Face model kept as
``self.model``, say), opens a ``Run`` and attaches the monitors with their overhead
budget to the trainer's (torch) optimizer. After every training batch it flushes when
the optimizer stepped (``trainer.global_step`` moved) and otherwise marks a
gradient-accumulation micro-batch, whose values join the next step's
(``MonitorHandle.step(..., accumulate=True)``). At fit end it closes both. The
records' step is the optimizer step, ``global_step - 1``. The loss ``training_step``
returned is checked for NaN/Inf at every batch (on the device); under
``on_nonfinite="raise"`` a NaN/Inf readout sets ``trainer.should_stop`` (the fit loop
ends, ``on_fit_end`` closes the run) and keeps the error in ``stopped_by``.

Like the Hugging Face callback, ``monitors/global/grad_norm`` covers the decoder
layers' gradients after any clipping (``gradient_clip_val``), read in the optimizer's
pre-step hook.
"""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import Callback

from syncless.errors import UsageError
from syncless.integrations.session import MonitorSession, unwrap_optimizer
from syncless.monitors.adapters import find_layers


def monitored_model(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` if an adapter maps it, else its first child (depth first) that maps."""
    for candidate in [module, *module.modules()]:
        try:
            find_layers(candidate)
        except UsageError:
            continue
        return candidate
    raise UsageError(
        f"SynclessCallback: no model syncless's adapters recognise inside "
        f"{type(module).__name__} (docs/adapters.md: register an adapter for it)"
    )


class SynclessCallback(MonitorSession, Callback):
    """The monitors in a Lightning ``Trainer`` (module doc); arguments as
    ``MonitorSession``'s."""

    run_name = "lightning"
    _steps_seen = 0  # trainer.global_step at the last batch end

    def on_fit_start(self, trainer, pl_module) -> None:
        optimizers = [unwrap_optimizer(o) for o in trainer.optimizers]
        if "norms" in self.monitors and len(optimizers) > 1:
            raise UsageError(
                f"SynclessCallback: the norms monitor hooks one optimizer; this trainer "
                f"has {len(optimizers)}: leave norms out of monitors="
            )
        self.open(monitored_model(pl_module), optimizers[0] if optimizers else None)
        self._steps_seen = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.handle is None:
            return
        stepped = trainer.global_step != self._steps_seen
        self._steps_seen = trainer.global_step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        loss = loss.detach() if isinstance(loss, torch.Tensor) else None
        if self.step(trainer.global_step - 1, accumulate=not stepped, loss=loss):
            trainer.should_stop = True  # on_nonfinite="raise": the fit loop ends cleanly

    def on_fit_end(self, trainer, pl_module) -> None:
        self.close()
