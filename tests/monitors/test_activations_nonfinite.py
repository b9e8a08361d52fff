import math

import numpy as np
import pytest
import torch

from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.guard import no_sync
from syncless.metrics import MetricSet
from syncless.monitors import attach
from syncless.monitors.activations import ActivationsMonitor
from syncless.monitors.base import MonitorContext
from syncless.monitors.nonfinite import NonFiniteMonitor


def _model(seed=0):
    torch.manual_seed(seed)
    model = MoETransformer(preset("tiny"))
    init_weights(model, seed)
    return model


def _block_outputs(model, tokens):
    """Ground truth: the blocks' outputs from a plain forward, no hooks."""
    outs = []
    x = model.embed(tokens)
    with torch.no_grad():
        for layer in model.layers:
            x, _ = layer(x)
            outs.append(x.clone())
    return outs


@pytest.mark.parametrize("launch", ["layer", "grouped"])
def test_activation_statistics_match_a_naive_recount(launch, kernel_backend):
    model = _model()
    thresholds = (0.5, 1.0, 2.0)
    mon = ActivationsMonitor(thresholds=thresholds, launch=launch)
    handle = attach(model, [mon], lagged=False)
    batches = [torch.randint(0, 256, (3, 16)), torch.randint(0, 256, (2, 16))]
    with no_sync(cpu_as_device=True):
        for tokens in batches:
            logits, balance = model(tokens)
            (logits.square().mean() + balance).backward()
    records = {r.name: r.value for r in handle.step(0)}
    handle.close()
    if launch == "grouped" and kernel_backend == "triton":
        # one grouped launch per forward (every layer of the model, in one go)
        assert (mon._batch.grouped_launches, mon._batch.single_launches) == (2, 0)

    per_layer = [[] for _ in model.layers]
    for tokens in batches:
        for i, out in enumerate(_block_outputs(model, tokens)):
            per_layer[i].append(out.reshape(-1, out.shape[-1]))
    tops = []
    for i, outs in enumerate(per_layer):
        x = torch.cat(outs).numpy()
        channel_max = [max(abs(float(v)) for v in x[:, c]) for c in range(x.shape[1])]
        top = max(channel_max)
        tops.append(top)
        scope = f"monitors/layer_{i:02d}"
        assert records[f"{scope}/act_absmax"] == pytest.approx(top, rel=1e-6)
        assert records[f"{scope}/act_channel_absmax"] == pytest.approx(top, rel=1e-6)
        assert records[f"{scope}/act_max_median_ratio"] == pytest.approx(
            top / float(np.median(channel_max)), rel=1e-6
        )
        for t, label in zip(thresholds, ("0p5", "1", "2"), strict=True):
            expected = sum(1 for v in channel_max if v > t)
            assert records[f"{scope}/act_channels_above_{label}_count"] == expected
    assert records["monitors/global/act_absmax"] == pytest.approx(max(tops), rel=1e-6)
    # the per-channel vector stays out of the step records
    assert not any("/act_channel_absmax/channel_" in n for n in records)


@pytest.mark.parametrize("launch", ["layer", "grouped"])
def test_nonfinite_counts_and_device_alert(launch, kernel_backend):
    model = _model()
    mon = NonFiniteMonitor(launch=launch)
    handle = attach(model, [mon], lagged=False)
    tokens = torch.randint(0, 256, (2, 8))
    with torch.no_grad():
        model.layers[1].moe.router.gate.weight[0, 0] = float("nan")
    with no_sync(cpu_as_device=True):
        model(tokens)  # with autograd on: the grouped launch holds the layers' outputs
        alert = mon.alert.clone()  # on the device, no read-back
    records = {r.name: r.value for r in handle.step(0)}
    handle.close()  # the reference forward below must not feed the monitor
    truth = [int((~torch.isfinite(o)).sum()) for o in _block_outputs(model, tokens)]
    assert truth[0] == 0 and truth[1] > 0  # the NaN router weight poisons layer 1 only
    assert records["monitors/layer_00/nonfinite_count"] == truth[0]
    assert records["monitors/layer_01/nonfinite_count"] == truth[1]
    assert records["monitors/step/nonfinite_alert_count"] == max(truth)
    assert float(alert) == max(truth)  # grouped too: set when the forward passed layer 1
    if launch == "grouped" and kernel_backend == "triton":
        assert (mon._batch.grouped_launches, mon._batch.single_launches) == (1, 0)


def test_shared_output_read_matches_naive_recounts_and_keeps_each_cadence(kernel_backend):
    """Activations and nonfinite attached together share one read of each output
    (syncless.monitors.output_read): per-channel maxima and NaN/Inf counts against
    plain recounts, the alert on the device; a step where only nonfinite is active uses
    its own read."""
    model = _model()
    acts, nonf = ActivationsMonitor(every=2), NonFiniteMonitor()
    handle = attach(model, [acts, nonf], lagged=False)
    # one hook per block for both monitors, on both backends
    assert [len(b._forward_hooks) for b in model.layers] == [1] * len(model.layers)
    tokens = torch.randint(0, 256, (2, 8))
    with no_sync(cpu_as_device=True):
        model(tokens)  # step 0: both active
    clean = {r.name: r.value for r in handle.step(0)}
    with torch.no_grad():
        model.layers[1].moe.router.gate.weight[0, 0] = float("nan")
    with no_sync(cpu_as_device=True):
        model(tokens)  # step 1: nonfinite only (activations every 2)
        alert = nonf.alert.clone()
    poisoned = {r.name: r.value for r in handle.step(1)}
    handle.close()

    outs = _block_outputs(_model(), tokens)
    for i, out in enumerate(outs):
        scope = f"monitors/layer_{i:02d}"
        top = float(out.abs().max())
        assert clean[f"{scope}/act_absmax"] == pytest.approx(top, rel=1e-6)
        assert clean[f"{scope}/nonfinite_count"] == 0
    assert clean["monitors/step/nonfinite_alert_count"] == 0
    poisoned_model = _model()
    with torch.no_grad():
        poisoned_model.layers[1].moe.router.gate.weight[0, 0] = float("nan")
    truth = [int((~torch.isfinite(o)).sum()) for o in _block_outputs(poisoned_model, tokens)]
    assert truth[0] == 0 and truth[1] > 0
    assert poisoned["monitors/layer_01/nonfinite_count"] == truth[1]
    assert poisoned["monitors/step/nonfinite_alert_count"] == float(alert) == max(truth)
    assert not any(n.endswith("/act_absmax") for n in poisoned)  # activations were off
    shared = acts._shared
    assert shared is not None and shared in handle.ctx.batches
    if kernel_backend == "triton":
        assert (shared.grouped_launches, shared.single_launches) == (1, 0)
        assert (nonf._batch.grouped_launches, acts._batch.grouped_launches) == (1, 0)
    else:  # the torch ops record in the hooks; no batch launches
        assert (shared.grouped_launches, shared.single_launches) == (0, 0)


def test_cadence_inactive_steps_record_nothing_and_close_removes_hooks():
    model = _model()
    mon = ActivationsMonitor(every=2)
    handle = attach(model, [mon], lagged=False, budget=None)  # every=2 exactly
    hooks_before = sum(len(m._forward_hooks) for m in model.modules())
    assert hooks_before == len(model.layers)
    tokens = torch.randint(0, 256, (2, 8))
    seen = []
    for step in range(4):
        with no_sync(cpu_as_device=True), torch.no_grad():
            model(tokens)
        seen.append(bool(handle.step(step)))
    assert seen == [True, False, True, False]  # every=2: steps 0 and 2 only
    handle.close()
    assert sum(len(m._forward_hooks) for m in model.modules()) == 0


def test_tensor_parallel_channel_shards_assemble_with_the_max_collective():
    """Two simulated TP ranks each hold half the channels; one MAX over the slices
    (what the flush's collective does) gives the full-width vector."""
    width = 8
    shards = []
    full = torch.randn(5, width)
    for rank in range(2):
        ms = MetricSet()
        mon = ActivationsMonitor(channel_shard=(rank, 2))
        ctx = MonitorContext(model=_FakeMap(width), metrics=ms)
        mon.prepare(ctx)
        ms.allocate("cpu")
        mon.attach(ctx)
        part = full[:, rank * 4 : (rank + 1) * 4]
        with no_sync(cpu_as_device=True):
            ctx.model.layers[0].fire(part)
        (r,) = ms.flush(0, wait=True)
        shards.append(np.where(r.present["monitors/layer_00/act_channel_absmax"],
                               r.values["monitors/layer_00/act_channel_absmax"], -math.inf))  # fmt: skip
    np.testing.assert_allclose(np.maximum(*shards), full.abs().amax(0).numpy())


class _FakeLayer:
    index = 0

    def __init__(self):
        self.callbacks = []

    def attach_output(self, callback):
        self.callbacks.append(callback)
        return []

    def fire(self, hidden):
        for cb in self.callbacks:
            cb(hidden)


class _FakeMap:
    def __init__(self, width):
        self.d_model = width
        self.layers = [_FakeLayer()]


class _BrokenDerive(ActivationsMonitor):
    def derive(self, readout):
        raise ZeroDivisionError("a bug in derive")


def test_a_failing_derive_is_counted_not_raised_unless_strict(capsys):
    model = _model()
    handle = attach(model, [_BrokenDerive()], lagged=False)
    tokens = torch.randint(0, 256, (2, 8))
    for step in range(2):
        with no_sync(cpu_as_device=True), torch.no_grad():
            model(tokens)
        records = {r.name: r.value for r in handle.step(step)}
    assert records["monitors/self/activations_derive_errors_count"] == 2
    assert "monitors/layer_00/act_channel_absmax" in records  # the raw values still land
    assert "activations derive failed" in capsys.readouterr().err
    handle.close()

    strict = attach(model, [_BrokenDerive()], lagged=False, strict=True)
    with no_sync(cpu_as_device=True), torch.no_grad():
        model(tokens)
    with pytest.raises(ZeroDivisionError):
        strict.step(0)
    strict.close()


def test_grouped_launch_falls_back_per_layer_when_the_set_is_incomplete(kernel_backend):
    """A forward cut short (only layer 0 ran before the flush) launches that layer alone,
    and its value is still exact."""
    if kernel_backend != "triton":
        pytest.skip("the grouped path is the Triton path")
    model = _model()
    mon = ActivationsMonitor(launch="grouped")
    handle = attach(model, [mon], lagged=False)
    tokens = torch.randint(0, 256, (2, 8))
    with no_sync(cpu_as_device=True):
        model.layers[0](model.embed(tokens))
        assert list(mon._batch._pending) == [0]  # held: layer 1 may still come
    records = {r.name: r.value for r in handle.step(0)}
    handle.close()
    expected = _block_outputs(model, tokens)[0].abs().max().item()
    assert records["monitors/layer_00/act_absmax"] == pytest.approx(expected, rel=1e-6)
    assert "monitors/layer_01/act_absmax" not in records
    assert (mon._batch.grouped_launches, mon._batch.single_launches) == (0, 1)


def test_grouped_launch_does_not_hold_tensors_in_an_evaluation_forward(kernel_backend):
    """Under no_grad nothing else keeps the layer outputs alive: each layer launches."""
    if kernel_backend != "triton":
        pytest.skip("the grouped path is the Triton path")
    model = _model()
    mon = ActivationsMonitor(launch="grouped")
    handle = attach(model, [mon], lagged=False)
    tokens = torch.randint(0, 256, (2, 8))
    with no_sync(cpu_as_device=True), torch.no_grad():
        model(tokens)
        assert not mon._batch._pending
    records = {r.name: r.value for r in handle.step(0)}
    handle.close()
    for i, out in enumerate(_block_outputs(model, tokens)):
        got = records[f"monitors/layer_{i:02d}/act_absmax"]
        assert got == pytest.approx(out.abs().max().item(), rel=1e-6)
    assert (mon._batch.grouped_launches, mon._batch.single_launches) == (0, len(model.layers))


def test_bad_launch_mode_is_rejected(monkeypatch):
    with pytest.raises(ValueError, match="expected one of layer, grouped"):
        ActivationsMonitor(launch="fused")
    monkeypatch.setenv("SYNCLESS_MONITOR_LAUNCH", "sometimes")
    with pytest.raises(ValueError, match="SYNCLESS_MONITOR_LAUNCH"):
        ActivationsMonitor()


@pytest.mark.parametrize("shape", [(24, 1024), (3, 7), (1, 1), (5, 2)])
def test_row_medians_match_numpy(shape):
    from syncless.monitors.activations import _row_medians

    x = np.random.default_rng(1).normal(size=shape)
    if shape[0] > 2:
        x[1, 0] = np.nan  # a row with a NaN has a NaN median, as np.median says
    np.testing.assert_array_equal(_row_medians(x.copy()), np.median(x, axis=1))
