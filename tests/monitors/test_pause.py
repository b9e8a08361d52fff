"""Pausing a monitor handle: nothing is measured while paused, the budget keeps what it
learnt and measures no step period across the pause.

Ground truth: the blocks' outputs recomputed by a plain forward (no hooks) of the steps
that were not paused; the paused steps feed inputs scaled far beyond them, so a single
paused measurement leaking into the records would show.
"""

from __future__ import annotations

import pytest
import torch

from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.guard import no_sync
from syncless.monitors import attach
from syncless.monitors.activations import ActivationsMonitor
from syncless.monitors.budget import Budget


def _model() -> MoETransformer:
    torch.manual_seed(0)
    model = MoETransformer(preset("tiny"))
    init_weights(model, 0)
    return model


def _absmax_per_layer(model: MoETransformer, tokens: torch.Tensor, scale: float) -> list[float]:
    out = []
    with torch.no_grad():
        x = model.embed(tokens) * scale
        for layer in model.layers:
            x, _ = layer(x)
            out.append(float(x.abs().max()))
    return out


def _step(model: MoETransformer, tokens: torch.Tensor, scale: float) -> None:
    # The embedding scaled in the forward itself: the hooks see what the reference sees.
    handle = model.embed.register_forward_hook(lambda _m, _a, out: out * scale)
    try:
        logits, balance = model(tokens)
        (logits.square().mean() + balance).backward()
    finally:
        handle.remove()


def test_a_paused_handle_measures_nothing_and_resumes_where_it_was() -> None:
    model = _model()
    handle = attach(model, [ActivationsMonitor(every=1)], lagged=False, budget=None)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    seen: dict[int, dict[str, float]] = {}
    with no_sync(cpu_as_device=True):
        for step in range(6):
            paused = step in (2, 3)
            if step == 2:
                handle.pause()
            if step == 4:
                handle.resume()
            _step(model, tokens, 1000.0 if paused else 1.0)
            records = handle.step(step)
            seen[step] = {r.name: r.value for r in records if r.step == step}
    handle.close()
    assert seen[2] == {} and seen[3] == {}  # nothing flushed while paused
    want = _absmax_per_layer(model, tokens, 1.0)
    for step in (0, 1, 4, 5):
        for i, top in enumerate(want):
            got = seen[step][f"monitors/layer_{i:02d}/act_absmax"]
            assert got == pytest.approx(top, rel=1e-5), (step, i)


def test_the_budget_measures_no_period_across_a_pause() -> None:
    now = [0.0]
    budget = Budget(0.01, {"a": 1}, "cpu")
    budget.clock = lambda: now[0]
    for _ in range(2):  # one period of 100 ms
        now[0] += 0.1
        budget.step_end(["a"], {"a": 1000})
    budget.pause()
    now[0] += 1000.0  # a long evaluation
    budget.step_end(["a"], {"a": 1000})  # the first step after resume: no period
    assert budget.step_ms == pytest.approx(100.0)  # a period across it: 500050 ms
    now[0] += 0.1
    budget.step_end(["a"], {"a": 1000})
    assert budget.step_ms == pytest.approx(100.0)


def test_readouts_that_land_while_paused_still_reach_the_run(tmp_path) -> None:
    """Lagged, on the readout thread: the step before the pause is read out during it;
    its records must reach the run, not only the caller."""
    from syncless.run import Run

    model = _model()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    with Run(name="pause", run_dir=tmp_path / "run") as run:
        emitted = []
        run.emit = emitted.extend  # what the handle hands the run, as it hands it
        handle = attach(model, [ActivationsMonitor(every=1)], run=run, background=True, budget=None)
        with no_sync(cpu_as_device=True):
            for step in range(4):
                if step == 2:
                    handle.pause()
                _step(model, tokens, 1.0)
                handle.step(step)
        handle.close()
    name = "monitors/layer_00/act_absmax"
    steps = sorted(r.step for r in emitted if r.name == name)
    assert steps == [0, 1]  # both measured steps, each once; nothing from the paused ones
    want = _absmax_per_layer(model, tokens, 1.0)[0]
    assert all(r.value == pytest.approx(want, rel=1e-5) for r in emitted if r.name == name)
