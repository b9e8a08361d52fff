"""The Hugging Face Trainer callback, through examples/hf_trainer.py (issue #20).

Ground truth: the test's own optimizer pre-step hook on the real (unwrapped) optimizer,
registered after syncless's, reads decoder layer 0's parameters and gradients in
float64 at every optimizer step, as the norms monitor must: after the Trainer's
clipping, before the update. Accelerate wraps the optimizer (AcceleratedOptimizer) and
the run uses gradient accumulation.
"""

from __future__ import annotations

import pytest
from integration_helpers import assert_layer_norms, load_example, record_layer_norms

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from syncless.integrations.session import unwrap_optimizer  # noqa: E402
from syncless.run import open as open_run  # noqa: E402


class _Truth(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.norms: list[tuple[float, float]] = []

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        real = unwrap_optimizer(optimizer)
        assert real is not optimizer  # Accelerate wrapped it: the case that broke
        record_layer_norms(model.model.layers[0], real, self.norms)


def test_the_callback_records_every_optimizer_steps_norms(tmp_path):
    truth = _Truth()
    argv = ["--steps", "4", "--accumulate", "2", "--output-dir", str(tmp_path / "out"),
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    callback = load_example("hf_trainer").main(argv, callbacks=(truth,))
    assert callback.run.dir == tmp_path / "run"
    # one flush per optimizer step; the Trainer's micro-batches never reach the handle
    assert (callback.handle.optimizer_steps, callback.handle.micro_steps) == (4, 0)
    assert len(truth.norms) == 4
    assert_layer_norms(callback.run.dir, truth.norms)
    with open_run(callback.run.dir) as store:
        _, attention = store.query(
            "SELECT count(DISTINCT step) FROM metrics "
            "WHERE name = 'monitors/global/attn_qk_logit_max'"
        )
    assert attention[0][0] >= 1


class _Planter(transformers.TrainerCallback):
    """NaN into decoder layer 1's input from optimizer step 2 on."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        from integration_helpers import NanFrom

        self.nan = NanFrom(model.model.layers[1], at=2)

    def on_step_end(self, args, state, control, **kwargs):
        self.nan.step = state.global_step  # the next step's label


def test_on_nonfinite_raise_stops_the_trainer_cleanly(tmp_path):
    argv = ["--steps", "20", "--accumulate", "1", "--output-dir", str(tmp_path / "out"),
            "--run-dir", str(tmp_path / "run"), "--on-nonfinite", "raise"]  # fmt: skip
    callback = load_example("hf_trainer").main(argv, callbacks=(_Planter(),))
    event = callback.stopped_by.event
    assert (event.first_step, event.first_layer) == (2, 1)
    # stopped through control.should_training_stop, well before max_steps
    assert 2 < callback.handle.optimizer_steps < 20
    assert callback.handle._closed
    with open_run(callback.run.dir) as store:
        _, rows = store.query(
            "SELECT min(value) FROM metrics WHERE name = 'monitors/step/nonfinite_first_step'"
        )
    assert rows[0][0] == 2
