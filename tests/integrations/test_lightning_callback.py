"""The Lightning callback, through examples/lightning_trainer.py (issue #20).

Ground truth: the test's own optimizer pre-step hook, registered after syncless's,
reads decoder layer 0's parameters and gradients in float64 at every optimizer step
(after Lightning's gradient clipping, before the update). The run accumulates
gradients over 2 batches: the callback must flush once per optimizer step.
"""

from __future__ import annotations

import pytest
from integration_helpers import assert_layer_norms, load_example, record_layer_norms

lightning = pytest.importorskip("lightning")
pytest.importorskip("transformers")

from syncless.run import open as open_run  # noqa: E402


class _Truth(lightning.pytorch.callbacks.Callback):
    def __init__(self) -> None:
        self.norms: list[tuple[float, float]] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        record_layer_norms(pl_module.model.model.layers[0], trainer.optimizers[0], self.norms)


def test_the_callback_flushes_once_per_optimizer_step(tmp_path):
    truth = _Truth()
    argv = ["--steps", "4", "--accumulate", "2", "--run-dir", str(tmp_path / "run")]
    callback = load_example("lightning_trainer").main(argv, callbacks=(truth,))
    assert len(truth.norms) == 4
    assert_layer_norms(callback.run.dir, truth.norms)
    with open_run(callback.run.dir) as store:
        _, steps = store.query(
            "SELECT DISTINCT step FROM metrics WHERE name = 'monitors/self/flush_host_ms'"
        )
    # 8 batches: 4 optimizer steps flushed, 4 micro-batches accumulated
    assert (callback.handle.optimizer_steps, callback.handle.micro_steps) == (4, 4)
    assert {s for (s,) in steps} <= {0, 1, 2, 3}  # labelled by optimizer step


class _Planter(lightning.pytorch.callbacks.Callback):
    """NaN into decoder layer 1's input from optimizer step 2 on."""

    def on_fit_start(self, trainer, pl_module) -> None:
        from integration_helpers import NanFrom

        self.nan = NanFrom(pl_module.model.model.layers[1], at=2)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.nan.step = trainer.global_step


def test_on_nonfinite_raise_stops_the_trainer_cleanly(tmp_path):
    argv = ["--steps", "20", "--accumulate", "1", "--run-dir", str(tmp_path / "run"),
            "--on-nonfinite", "raise"]  # fmt: skip
    callback = load_example("lightning_trainer").main(argv, callbacks=(_Planter(),))
    event = callback.stopped_by.event
    assert (event.first_step, event.first_layer) == (2, 1)
    assert event.loss_first_step == 2  # training_step's loss, checked on the device
    assert 2 < callback.handle.optimizer_steps < 20  # trainer.should_stop ended the fit
    assert callback.handle._closed
    with open_run(callback.run.dir) as store:
        _, rows = store.query(
            "SELECT min(value) FROM metrics WHERE name = 'monitors/step/nonfinite_first_step'"
        )
    assert rows[0][0] == 2
