"""The monitors inside a captured step (issue #45), on a CPU through StandInGraph.

A replay re-runs the captured ops and no Python: the hooks' host cadence checks, the
step label written on the host, a budget's decisions, all of them ran once, at capture.
These tests capture a whole forward and backward once and replay it for 20+ steps, as
torchtitan does (an eager warm-up step, a capture, replays; the optimizer outside), and
check that every monitor records on each of its active steps exactly what an eager run
of the same steps records, and nothing on its other steps. The eager run's values are
themselves checked against recounts in the other monitor tests. Both kernel backends
run: the stand-in replays the Triton interpreter's launches too (syncless.graphs).
"""

from __future__ import annotations

import math

import pytest
import torch

from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.errors import UsageError
from syncless.graphs import StandInGraph
from syncless.guard import no_sync
from syncless.monitors import attach
from syncless.monitors.activations import ActivationsMonitor
from syncless.monitors.attention import AttentionMonitor
from syncless.monitors.moe import MoEMonitor
from syncless.monitors.nonfinite import NonFiniteMonitor
from syncless.monitors.norms import NormsMonitor
from syncless.monitors.silence import SILENT_STEPS

STEPS = 21  # step 0 eager (the warm-up), then 20 replays
VOCAB = 256
CADENCES = {"attention": 2, "moe": 3, "activations": 1, "nonfinite": 4, "norms": 5}


def _model() -> MoETransformer:
    model = MoETransformer(preset("tiny"))
    init_weights(model, 0)
    return model


def _batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(steps)]


def _monitors(opt: torch.optim.Optimizer) -> list:
    return [
        AttentionMonitor(every=CADENCES["attention"]),
        MoEMonitor(every=CADENCES["moe"]),
        ActivationsMonitor(every=CADENCES["activations"]),
        NonFiniteMonitor(every=CADENCES["nonfinite"]),
        NormsMonitor(opt, every=CADENCES["norms"]),
    ]


def _loss(model: MoETransformer, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)[0]
    return torch.nn.functional.cross_entropy(
        logits.flatten(0, 1).float(), tokens.roll(-1, dims=1).flatten()
    )


class Trainer:
    """One model, its optimizer and handle; ``graphed``: step 0 eager (the warm-up),
    step 1 captured then replayed, later steps replayed, as torchtitan's wrapper."""

    def __init__(
        self, graphed: bool, first_label: int = 0, stride: int = 1, poison: int = -1, **attach_kw
    ):
        self.model = _model()
        # a fault hook on layer ``poison``, registered before attach (the monitors see it)
        self.poison = Poison(self.model, poison) if poison >= 0 else None
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2)
        monitors = attach_kw.pop("monitors", None) or _monitors(self.opt)
        attach_kw.setdefault("budget", None)
        self.handle = attach(self.model, monitors, lagged=False, **attach_kw)
        self.graphed = graphed
        self.graph: StandInGraph | None = None
        self.tokens = torch.zeros(2, 16, dtype=torch.long)  # the captured (static) input
        self.loss: torch.Tensor | None = None
        self.label = lambda i: first_label + stride * i
        self.records: list = []

    def forward_backward(self) -> torch.Tensor:
        loss = _loss(self.model, self.tokens)
        loss.backward()
        return loss.detach()

    def step(self, i: int, batch: torch.Tensor, update: bool = True) -> None:
        with no_sync(cpu_as_device=True):
            self.tokens.copy_(batch)
            if not self.graphed or i == 0:
                self.loss = self.forward_backward()
            else:
                if self.graph is None:
                    self.graph = StandInGraph()
                    with self.graph.capture():
                        self.loss = self.forward_backward()
                self.graph.replay()
            if update:
                self.opt.step()
            self.opt.zero_grad(set_to_none=False)
            assert self.loss is not None
            self.records += self.handle.step(self.label(i), loss=self.loss)

    def close(self) -> list:
        self.records += self.handle.close()
        return self.records


def _by_step(records) -> dict[tuple[int, str], float]:
    return {
        (r.step, r.name): r.value
        for r in records
        if r.name.startswith("monitors/") and "/self/" not in r.name
    }


def _run(graphed: bool, steps: int = STEPS, **kw) -> list:
    trainer = Trainer(graphed, **kw)
    for i, batch in enumerate(_batches(steps)):
        trainer.step(i, batch)
    return trainer.close()


def test_every_monitor_records_in_replays_what_an_eager_run_records():
    eager, graphed = _by_step(_run(False)), _by_step(_run(True))
    assert graphed.keys() == eager.keys()
    for key, value in eager.items():
        assert math.isclose(graphed[key], value, rel_tol=1e-5, abs_tol=1e-9) or (
            math.isnan(value) and math.isnan(graphed[key])
        ), (key, value, graphed[key])
    # each monitor's own records are there exactly at its active steps (device gates
    # keep a replayed hook from recording at the others)
    markers = {
        "attention": "monitors/layer_00/attn_qk_logit_max",
        "moe": "monitors/layer_00/moe_imbalance",
        "activations": "monitors/layer_00/act_absmax",
        "norms": "monitors/layer_00/param_norm",
    }
    for name, marker in markers.items():
        steps = sorted({step for step, key in graphed if key.startswith(marker)})
        assert steps == list(range(0, STEPS, CADENCES[name])), (name, steps)


def test_monitors_attached_with_the_default_budget_learn_from_replays():
    """Under a graph the budget sees no hook time: cadences aligned to powers of two
    (steps without a monitor are its baseline), costs from step times."""
    trainer = Trainer(True, budget=0.01, monitors=None)
    for i, batch in enumerate(_batches(40)):
        trainer.step(i, batch)
    handle = trainer.handle
    assert handle.ctx.graphed and handle.budget is not None and handle.budget.aligned
    inside = {"attention", "moe", "activations"}  # the norms hook the eager optimizer
    assert inside <= handle.budget.compiled
    assert "norms" not in handle.budget.compiled
    for name, every in handle.cadences.items():
        assert every & (every - 1) == 0, (name, every)  # a power of two
    trainer.close()


class Poison:
    """Multiplies one layer's output by a device scalar: 1, or NaN at a chosen replay.
    Registered before attach and captured with the step, as a real fault would be."""

    def __init__(self, model: MoETransformer, layer: int) -> None:
        self.factor = torch.ones(())
        model.layers[layer].register_forward_hook(lambda m, a, out: self._apply(out))

    def _apply(self, out):
        if isinstance(out, tuple):
            return (out[0] * self.factor, *out[1:])
        return out * self.factor


@pytest.mark.parametrize("at", [2, 9, 17])
def test_a_nan_at_any_replayed_step_is_caught_with_its_step_and_layer(at):
    """The alarm's readout every 4 steps; the NaN lands in one replay only (its
    update skipped, so later steps are clean again)."""
    trainer = Trainer(True, monitors=[NonFiniteMonitor(every=4)], first_label=1, poison=1)
    poison = trainer.poison
    assert poison is not None
    for i, batch in enumerate(_batches(20)):
        poison.factor.fill_(float("nan") if i == at else 1.0)
        trainer.step(i, batch, update=i != at)
    records = trainer.close()
    label = 1 + at  # torchtitan numbers its steps from 1
    first = [(r.step, r.value) for r in records if r.name == "monitors/step/nonfinite_first_step"]
    layer = [r.value for r in records if r.name == "monitors/step/nonfinite_first_layer"]
    assert [v for _, v in first] == [label] and layer == [1.0]
    # read by the readout after it, or by close() after the last step (label 20)
    assert first[0][0] == min(1 + 4 * math.ceil(at / 4), 20)
    loss = [r.value for r in records if r.name == "monitors/step/loss_nonfinite_first_step"]
    assert loss == [label]
    assert trainer.handle.alarm is not None
    (event,) = trainer.handle.alarm.events
    assert (event.first_step, event.first_layer) == (label, 1)


def test_step_labels_numbered_in_strides_survive_the_graph():
    trainer = Trainer(
        True, monitors=[NonFiniteMonitor(every=3)], first_label=100, stride=10, poison=0
    )
    poison = trainer.poison
    assert poison is not None
    for i, batch in enumerate(_batches(9)):
        poison.factor.fill_(float("nan") if i == 5 else 1.0)
        trainer.step(i, batch, update=i != 5)
    records = trainer.close()
    first = [r.value for r in records if r.name == "monitors/step/nonfinite_first_step"]
    assert first == [150.0]


def test_a_paused_handle_records_nothing_from_replays():
    trainer = Trainer(True)
    batches = _batches(9)
    for i in range(4):
        trainer.step(i, batches[i])
    trainer.handle.pause()
    before = trainer.handle.metrics.buffer.clone()
    assert trainer.graph is not None
    for _ in range(3):
        trainer.graph.replay()  # every gate off: nothing lands
    torch.testing.assert_close(trainer.handle.metrics.buffer, before, equal_nan=True)
    trainer.handle.resume()
    for i in range(4, 9):
        trainer.step(i, batches[i])
    steps = {r.step for r in trainer.close() if r.name == "monitors/layer_00/act_absmax"}
    assert steps == set(range(9))


def test_the_optimizer_step_captured_in_its_own_graph_keeps_the_norms():
    """The norms monitor's optimizer hooks captured with ``opt.step()`` (SGD: no host
    read in its step): the norms of each active step equal an eager run's."""

    def run(graphed: bool) -> dict:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
        handle = attach(model, [NormsMonitor(opt, every=3)], budget=None, lagged=False)
        graph = None
        records = []
        for i, batch in enumerate(_batches(8)):
            with no_sync(cpu_as_device=True):
                _loss(model, batch).backward()
                if not graphed or i == 0:
                    opt.step()
                else:
                    if graph is None:
                        graph = StandInGraph()
                        with graph.capture():
                            opt.step()
                    graph.replay()
                opt.zero_grad(set_to_none=False)
                records += handle.step(i)
        records += handle.close()
        return _by_step(records)

    eager, graphed = run(False), run(True)
    assert eager.keys() == graphed.keys() and eager
    for key, value in eager.items():
        assert math.isclose(graphed[key], value, rel_tol=1e-6), key
    assert {s for s, k in graphed if k.endswith("update_ratio")} == {0, 3, 6}


def test_handle_step_inside_the_capture_is_refused():
    trainer = Trainer(True, monitors=[NonFiniteMonitor()])
    graph = StandInGraph()
    with pytest.raises(UsageError, match=r"after graph\.replay"), graph.capture():
        trainer.handle.step(0)
    trainer.close()


def test_a_graph_captured_before_attach_is_named_not_silent(capfd):
    model = _model()
    tokens = _batches(1)[0]
    with no_sync(cpu_as_device=True):
        _loss(model, tokens).backward()
        graph = StandInGraph()
        with graph.capture():
            _loss(model, tokens).backward()
    handle = attach(model, [ActivationsMonitor()], budget=None, lagged=False)
    records = []
    for i in range(SILENT_STEPS + 2):
        with no_sync(cpu_as_device=True):
            graph.replay()
        records += handle.step(i)
    records += handle.close()
    err = capfd.readouterr().err
    assert err.count("monitor activations recorded nothing") == 1
    assert "captured before attach" in err
    silent = [r.value for r in records if r.name == "monitors/self/activations_silent_steps_count"]
    assert silent and silent[-1] == SILENT_STEPS + 2


def test_replays_after_close_leave_the_buffer_and_the_step_alone():
    trainer = Trainer(True)
    batches = _batches(6)
    for i in range(4):
        trainer.step(i, batches[i])
    graph = trainer.graph
    assert graph is not None
    trainer.close()
    metrics = trainer.handle.metrics
    assert float(metrics.gates.sum()) == 0.0  # every gate off
    before = metrics.buffer.clone()
    trainer.tokens.copy_(batches[5])
    graph.replay()
    torch.testing.assert_close(metrics.buffer, before, equal_nan=True)
    # training through the graph is unchanged by the dead hooks' kernels
    expected = _loss(trainer.model, batches[5]).detach()
    assert trainer.loss is not None
    torch.testing.assert_close(trainer.loss, expected)
