"""The nonfinite alarm never sleeps (issue #35): a NaN or Inf at one step, whatever the
cadence or budget, lands in the records with its step and layer, and the alarm acts.

The ground truth is a recount: the test's own hooks clone every block output of the
planted step, and the NaN/Inf elements are counted with ``torch.isfinite`` after the
step. On the code before #35 these tests fail: the NaN fell on a step where the
nonfinite monitor was not active, and nothing recorded it.
"""

from __future__ import annotations

import pytest
import torch

from syncless.guard import no_sync
from syncless.monitors import NonFiniteError, NonFiniteEvent, attach, build
from syncless.monitors.nonfinite import NonFiniteMonitor
from syncless.testing import spawn_gloo

transformers = pytest.importorskip("transformers")

LAYERS = 3
VOCAB = 64


def _llama(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).to(device)


class Plant:
    """Puts ``value`` into layer ``layer``'s output at step ``at`` (registered before
    attach, so the monitors see it) and clones every block output of that step."""

    def __init__(self, model: torch.nn.Module, at: int, layer: int, value: float) -> None:
        self.step = -1
        self.at, self.layer, self.value = at, layer, value
        self.outputs: dict[int, torch.Tensor] = {}
        for i, block in enumerate(model.model.layers):
            block.register_forward_hook(self._hook(i))

    def _hook(self, index: int):
        def hook(module, args, output):
            if self.step != self.at:
                return None
            out = output[0] if isinstance(output, tuple) else output
            if index == self.layer:
                out = out.clone()
                out[0, 1, :3] = self.value
            self.outputs[index] = out.detach().clone()
            if isinstance(output, tuple):
                return (out, *output[1:])
            return out

        return hook

    def truth(self) -> tuple[int, int, int]:
        """(NaN/Inf elements over every layer output, layers with one, first layer)."""
        counts = {i: int((~torch.isfinite(x)).sum()) for i, x in sorted(self.outputs.items())}
        bad = [i for i, n in counts.items() if n]
        return sum(counts.values()), len(bad), bad[0]


def _train(
    model,
    handle,
    plant: Plant | None,
    steps: int,
    *,
    skip_update_at: int = -1,
    grad_nan_at: int = -1,
    first_label: int = 0,
) -> list:
    """A plain loop; the update of ``skip_update_at`` is skipped (as a loss scaler
    would), so the NaN stays in one step. Returns every record, close() included."""
    opt = handle.nonfinite_test_optimizer
    records = []
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        step = first_label + i
        if plant is not None:
            plant.step = i
        tokens = torch.randint(0, VOCAB, (2, 8), generator=gen).to(model.device)
        with no_sync(cpu_as_device=True):
            loss = model(input_ids=tokens, labels=tokens).loss
            grad_norm = None
            if i == grad_nan_at:
                # One NaN in one gradient of layer 1; the update is undone afterwards (a
                # clip would spread the NaN to every gradient through its coefficient).
                loss.backward()
                kept = {k: v.clone() for k, v in model.state_dict().items()}
                model.model.layers[1].mlp.down_proj.weight.grad[0, 0] = float("nan")
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                grad_norm = torch.nn.utils.get_total_norm(grads)
                opt.step()
                model.load_state_dict(kept)
            elif i != skip_update_at:
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
                opt.step()
            opt.zero_grad()
        records += handle.step(step, loss=loss.detach(), grad_norm=grad_norm)
    records += handle.close()
    return records


def _attach(model, monitors=None, **kwargs):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if monitors is None:
        monitors = build("all", optimizer=opt)
    handle = attach(model, monitors, **kwargs)
    handle.nonfinite_test_optimizer = opt
    return handle


def _values(records, name: str) -> list[tuple[int, float]]:
    return [(r.step, r.value) for r in records if r.name == name]


def test_a_nan_at_one_step_is_recorded_under_the_default_budget():
    """The issue's case: attach(model, build("all", optimizer=opt)), default 1% budget,
    12 steps, a NaN in one layer's output at step 7 only."""
    model = _llama()
    plant = Plant(model, at=7, layer=1, value=float("nan"))
    handle = _attach(model)
    records = _train(model, handle, plant, steps=12, skip_update_at=7)
    total, layers, first_layer = plant.truth()
    assert _values(records, "monitors/step/nonfinite_first_step")[0][1] == 7
    assert [v for _, v in _values(records, "monitors/step/nonfinite_first_step")] == [7]
    assert [v for _, v in _values(records, "monitors/step/nonfinite_first_layer")] == [first_layer]
    assert first_layer == 1  # the planted layer; layer 0 before it stayed finite
    counts = _values(records, "monitors/global/nonfinite_count")
    assert sum(v for _, v in counts) == total
    per_layer = [
        sum(v for _, v in _values(records, f"monitors/layer_{i:02d}/nonfinite_count"))
        for i in range(LAYERS)
    ]
    assert sum(1 for n in per_layer if n) == layers
    # the loss of step 7 was NaN too (its update was skipped: nothing after it is)
    assert [v for _, v in _values(records, "monitors/step/loss_nonfinite_first_step")] == [7]
    assert sum(v for _, v in _values(records, "monitors/step/loss_nonfinite_count")) == 1


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_single_bad_step_between_readouts_keeps_its_step_and_counts(value):
    """Readouts every 4 steps (fixed): step 6 falls between two of them. Its counts,
    step and layer ride to the readout of step 8; the one of step 4 says nothing."""
    model = _llama()
    plant = Plant(model, at=6, layer=2, value=value)
    handle = _attach(model, [NonFiniteMonitor(every=4)], budget=None, lagged=False)
    records = _train(model, handle, plant, steps=10, skip_update_at=6)
    total, _, first_layer = plant.truth()
    assert _values(records, "monitors/step/nonfinite_first_step") == [(8, 6.0)]
    assert _values(records, "monitors/step/nonfinite_first_layer") == [(8, float(first_layer))]
    assert _values(records, "monitors/layer_02/nonfinite_first_step") == [(8, 6.0)]
    # close() reads the step after the last readout too (a NaN there is not lost)
    counts = _values(records, "monitors/global/nonfinite_count")
    assert counts == [(0, 0), (4, 0), (8, total), (9, 0)]
    # the alert is the largest count of the readout's own step, clean at step 8
    assert all(v == 0 for _, v in _values(records, "monitors/step/nonfinite_alert_count"))


def test_steps_labelled_from_elsewhere_keep_their_labels():
    """A resumed run's labels start at 1000: the device guessed 0 for the first step."""
    model = _llama()
    plant = Plant(model, at=0, layer=0, value=float("nan"))
    handle = _attach(model, [NonFiniteMonitor(every=2)], budget=None, lagged=False)
    records = _train(model, handle, plant, steps=4, skip_update_at=0, first_label=1000)
    assert _values(records, "monitors/step/nonfinite_first_step") == [(1000, 1000.0)]
    assert _values(records, "monitors/layer_00/nonfinite_first_step") == [(1000, 1000.0)]


def test_nonfinite_gradients_are_reported_by_the_grad_norm_check_and_per_layer():
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    mons = build(["nonfinite", "norms"], optimizer=opt)
    for m in mons:
        m.every = 1
    handle = attach(model, mons, budget=None, lagged=False)
    handle.nonfinite_test_optimizer = opt
    records = _train(model, handle, None, steps=6, grad_nan_at=3)
    assert _values(records, "monitors/step/grad_norm_nonfinite_first_step") == [(3, 3.0)]
    assert _values(records, "monitors/step/grad_nonfinite_first_layer") == [(3, 1.0)]
    assert _values(records, "monitors/step/grad_nonfinite_layers_count") == [(3, 1.0)]
    assert not _values(records, "monitors/step/nonfinite_first_step")  # outputs stayed finite


def test_a_nan_after_the_last_readout_is_read_at_close():
    """Readouts every 4 steps, 10 steps: the NaN of step 9 is counted by the alarm and
    read by close(), labelled with the last step."""
    model = _llama()
    plant = Plant(model, at=9, layer=0, value=float("nan"))
    handle = _attach(model, [NonFiniteMonitor(every=4)], budget=None, lagged=False)
    records = _train(model, handle, plant, steps=10, skip_update_at=9)
    total, _, _ = plant.truth()
    assert _values(records, "monitors/step/nonfinite_first_step") == [(9, 9.0)]
    assert _values(records, "monitors/global/nonfinite_count")[-1] == (9, total)


def test_warn_prints_one_line_naming_step_layer_and_count(capfd):
    model = _llama()
    plant = Plant(model, at=5, layer=1, value=float("nan"))
    handle = _attach(model, [NonFiniteMonitor(every=3)], budget=None, lagged=False)
    _train(model, handle, plant, steps=9, skip_update_at=5)
    total, layers, _ = plant.truth()
    lines = [line for line in capfd.readouterr().err.splitlines() if "NaN/Inf" in line]
    assert len(lines) == 1, lines
    assert "layer 1 output first at step 5" in lines[0]
    assert f"({total} values in {layers} layers)" in lines[0]
    assert "loss at step 5" in lines[0]


def test_raise_stops_the_loop_after_the_records_reach_the_run(tmp_path):
    from syncless.run import Run
    from syncless.run.store import RunStore

    model = _llama()
    plant = Plant(model, at=5, layer=0, value=float("inf"))
    run = Run(run_dir=tmp_path / "run")
    handle = _attach(model, [NonFiniteMonitor(every=3)], budget=None, run=run, on_nonfinite="raise")
    with pytest.raises(NonFiniteError) as caught:
        _train(model, handle, plant, steps=12, skip_update_at=5)
    event = caught.value.event
    assert (event.first_step, event.first_layer, event.readout_step) == (5, 0, 6)
    assert "layer 0 output first at step 5" in str(caught.value)
    # lagged: the readout of step 6 lands at the flush of step 9, which raises
    assert handle.optimizer_steps == 10
    # on disk before the error reached the loop: read while the run is still open
    _, rows = RunStore(tmp_path / "run").query(
        "SELECT step, value FROM metrics WHERE name = 'monitors/step/nonfinite_first_step'"
    )
    assert [tuple(r) for r in rows] == [(6, 5.0)]
    handle.close()
    run.close()


def test_a_callable_gets_the_event_and_training_goes_on():
    model = _llama()
    plant = Plant(model, at=2, layer=2, value=float("nan"))
    events: list[NonFiniteEvent] = []
    handle = _attach(
        model, [NonFiniteMonitor(every=2)], budget=None, lagged=False, on_nonfinite=events.append
    )
    _train(model, handle, plant, steps=6, skip_update_at=2)
    assert [(e.first_step, e.first_layer, e.readout_step) for e in events] == [(2, 2, 2)]


def test_bad_alarm_arguments_are_clear_errors():
    from syncless.errors import UsageError

    model = _llama()
    with pytest.raises(UsageError, match="on_nonfinite='stop'"):
        _attach(model, on_nonfinite="stop")
    with pytest.raises(UsageError, match="needs the nonfinite monitor"):
        _attach(model, build(["activations"]), on_nonfinite="raise")
    handle = _attach(model, build(["activations"]))
    with pytest.raises(UsageError, match="not attached"):
        handle.step(0, loss=torch.zeros(()))
    handle.close()
    handle = _attach(model, [NonFiniteMonitor()])
    with pytest.raises(UsageError, match="device tensor"):
        handle.step(0, loss=1.5)
    handle.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton fold)")
def test_on_cuda_the_grouped_fold_keeps_the_first_step_and_layer(monkeypatch):
    """The compiled Triton path (backend auto): one grouped read and one fold per
    forward write the counts, the alert and the first step; the loss check folds too."""
    from syncless import kernels

    monkeypatch.setenv("SYNCLESS_KERNELS", "auto")
    kernels.set_backend("auto")  # the fixture restores its own afterwards
    model = _llama("cuda")
    plant = Plant(model, at=6, layer=1, value=float("inf"))
    mon = NonFiniteMonitor(every=4)
    handle = _attach(model, [mon], budget=None, lagged=False)
    records = _train(model, handle, plant, steps=10, skip_update_at=6)
    total, _, first_layer = plant.truth()
    assert _values(records, "monitors/step/nonfinite_first_step") == [(8, 6.0)]
    assert _values(records, "monitors/step/nonfinite_first_layer") == [(8, float(first_layer))]
    # close() reads the step after the last readout too (a NaN there is not lost)
    counts = _values(records, "monitors/global/nonfinite_count")
    assert counts == [(0, 0), (4, 0), (8, total), (9, 0)]
    assert _values(records, "monitors/step/loss_nonfinite_first_step") == [(8, 6.0)]
    assert mon._batch is not None and mon._batch.grouped_launches >= 9


def _ranks(rank: int, world: int, action: str) -> dict:
    """Each rank trains its own copy; only rank 1 plants a NaN, at step 7 in layer 1."""
    model = _llama()
    plant = Plant(model, at=7 if rank == 1 else -1, layer=1, value=float("nan"))
    handle = _attach(model, on_nonfinite=action)  # build("all"), default budget
    raised_at = None
    records: list = []
    try:
        records = _train(model, handle, plant, steps=16, skip_update_at=7 if rank == 1 else -1)
    except NonFiniteError as e:
        raised_at = handle.optimizer_steps
        handle.close()
        return {"raised_at": raised_at, "first": (e.event.first_step, e.event.first_layer)}
    readouts = [
        (r.step, r.value) for r in records if r.name.startswith("monitors/step/nonfinite_first")
    ]
    total = plant.truth()[0] if rank == 1 else 0
    return {"readouts": readouts, "total": total, "raised_at": raised_at,
            "counts": sum(r.value for r in records if r.name == "monitors/global/nonfinite_count")}  # fmt: skip


@pytest.mark.dist
def test_two_ranks_agree_on_the_first_bad_step_and_layer():
    ranks = spawn_gloo(_ranks, 2, "warn")
    assert ranks[0]["readouts"] == ranks[1]["readouts"]
    names = [v for _, v in ranks[0]["readouts"]]
    assert names == [7.0, 1.0]  # first step, then first layer, of one readout
    # the counts are cluster-wide: rank 1's NaNs, on both ranks' view
    assert ranks[0]["counts"] == ranks[1]["counts"] == ranks[1]["total"]


@pytest.mark.dist
def test_two_ranks_raise_at_the_same_step():
    ranks = spawn_gloo(_ranks, 2, "raise")
    assert ranks[0]["raised_at"] is not None
    assert ranks[0]["raised_at"] == ranks[1]["raised_at"]
    assert ranks[0]["first"] == ranks[1]["first"] == (7, 1)
