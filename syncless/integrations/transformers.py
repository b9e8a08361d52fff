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
whose values join the step's); at train end it closes both. Under
``on_nonfinite="raise"`` a NaN/Inf readout stops training through
``control.should_training_stop`` (the Trainer ends the loop and calls
``on_train_end``, which closes the run); the error is kept in ``stopped_by``.

Definitions differ from the Trainer's own logs: ``monitors/global/grad_norm`` is the
norm of the decoder layers' gradients *after* the Trainer's clipping (the norms monitor
reads them in the optimizer's pre-step hook), while the Trainer logs ``grad_norm``,
the norm of every gradient (embeddings and head included) *before* clipping.
"""

from __future__ import annotations

from transformers import TrainerCallback

from syncless.integrations.session import MonitorSession, unwrap_model, unwrap_optimizer


class SynclessCallback(MonitorSession, TrainerCallback):
    """The monitors in a Hugging Face ``Trainer`` (module doc); arguments as
    ``MonitorSession``'s."""

    run_name = "hf-trainer"

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        config = {"trainer": {k: str(v) for k, v in args.to_dict().items()}}
        self.open(unwrap_model(model), unwrap_optimizer(optimizer), config)

    def on_step_end(self, args, state, control, **kwargs):
        # global_step counts finished steps; the Trainer hands callbacks neither the
        # loss nor the gradient norm as tensors: the layer outputs and norms are checked
        if self.handle is not None and self.step(state.global_step - 1):
            control.should_training_stop = True  # on_nonfinite="raise"

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
