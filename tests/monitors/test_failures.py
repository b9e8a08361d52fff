"""Never crash the step (issue #36): an exception inside syncless, in a hook (a
monitor's or an adapter's), in ``handle.step``, in a readout, a derive or
``handle.close``, is counted, reported once, and training goes on; ``strict=True``
raises it.

Ground truth: the same model trained without syncless (every loss and every final
parameter must be equal: the failures changed nothing in the step), and an exact count
of the injected failures (the hook's calls are counted by the test, outside syncless).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from matrix_models import HF_COMMON, families

from syncless.guard import no_sync
from syncless.monitors import attach, build
from syncless.run import Run
from syncless.run.store import RunStore

pytest.importorskip("transformers")

STEPS = 4
VOCAB = HF_COMMON["vocab_size"]
MONITORS = "attention,activations,nonfinite,norms"


@pytest.fixture(autouse=True)
def kernel_backend(monkeypatch):
    """The torch kernels only: where a failure is caught does not depend on the backend
    (tests/monitors/conftest.py runs the others under both)."""
    from syncless import kernels

    monkeypatch.setenv("SYNCLESS_KERNELS", "torch")
    previous = kernels.backend()
    kernels.set_backend("torch")
    yield "torch"
    kernels.set_backend(previous)


class Injected(Exception):
    """The failure the test plants."""


def _llama() -> torch.nn.Module:
    """The matrix's tiny 2-layer Hugging Face Llama (tests/monitors/matrix_models.py)."""
    return families()["hf-llama"].build()


class Calls:
    """How often a planted failure fired: counted here, not by syncless."""

    def __init__(self) -> None:
        self.n = 0

    def fail(self, *args: object, **kwargs: object) -> None:
        self.n += 1
        raise Injected(f"planted failure #{self.n}")


def _hook_factory(calls: Calls) -> Callable[..., Callable[..., None]]:
    return lambda *args, **kwargs: calls.fail


@dataclass
class Point:
    """Where a failure is planted: ``plant(monkeypatch, calls, handle)`` (handle is
    None before attach), the place syncless counts it under, and where strict raises."""

    place: str
    before_attach: bool
    plant: Callable[..., None]
    raises_in: str  # "forward", "optimizer", "step" or "close"


def _before(target: str, factory: bool = False) -> Callable[..., None]:
    def plant(monkeypatch, calls, handle):
        monkeypatch.setattr(target, _hook_factory(calls) if factory else calls.fail)

    return plant


def _after(attr: str) -> Callable[..., None]:
    def plant(monkeypatch, calls, handle):
        monkeypatch.setattr(handle.metrics, attr, calls.fail)

    return plant


POINTS = {
    # a monitor's own hook callback
    "monitor hook": Point(
        "attention_hook", True,
        _before("syncless.monitors.attention._LayerRecorder.record"), "forward",
    ),
    # the adapter's hook code around it (Llama rotates q/k by rotate-half)
    "adapter hook": Point(
        "attention_hook", True,
        _before("syncless.monitors.adapters.hf.make_rotary_post_hook", factory=True), "forward",
    ),
    "optimizer hook": Point(
        "norms_hook", True, _before("syncless.monitors.norms.NormsMonitor._pre_step"), "optimizer"
    ),
    "flush": Point("step", False, _after("flush_landed"), "step"),
    "decode": Point("readout", False, _after("decode"), "step"),
    "derive": Point(
        "activations_derive", True,
        _before("syncless.monitors.activations.ActivationsMonitor.derive"), "step",
    ),
    "monitor close": Point(
        "close", True, _before("syncless.monitors.nonfinite.NonFiniteMonitor.close"), "close"
    ),
    "drain": Point("close", False, _after("drain_landed"), "close"),
}  # fmt: skip


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (2, 9), generator=g) for _ in range(STEPS)]


def _train(handle_factory=None) -> tuple[list[float], list[torch.Tensor], object]:
    """Train STEPS steps; returns the losses, the final parameters and the handle."""
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = handle_factory(model, opt) if handle_factory else None
    losses = []
    for step, ids in enumerate(_batches()):
        # The hooks run under the guard: a failure must not be a sync in disguise.
        with no_sync(cpu_as_device=True):
            loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))  # the test's own read, after the step
        if handle is not None:
            checked = {"loss": loss.detach()} if handle.nonfinite is not None else {}
            handle.step(step, **checked)
    if handle is not None:
        handle.close()
    return losses, [p.detach().clone() for p in model.parameters()], handle


def _planted(spec: Point, monkeypatch, calls: Calls, model, opt, **attach_kwargs):
    """The monitors attached with the failure planted where ``spec`` says (before
    attach, or into the handle's metric set after it)."""
    if spec.before_attach:
        spec.plant(monkeypatch, calls, None)
    handle = attach(
        model, build(MONITORS, optimizer=opt), lagged=False, budget=None, background=False,
        **attach_kwargs,
    )  # fmt: skip
    if not spec.before_attach:
        spec.plant(monkeypatch, calls, handle)
    return handle


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], list[torch.Tensor]]:
    losses, params, _ = _train()
    return losses, params


@pytest.mark.parametrize("point", list(POINTS))
def test_a_failure_is_counted_reported_once_and_training_goes_on(
    point, reference, monkeypatch, capsys, tmp_path
):
    spec = POINTS[point]
    calls = Calls()
    run = Run(run_dir=tmp_path / "run")

    losses, params, handle = _train(
        lambda model, opt: _planted(spec, monkeypatch, calls, model, opt, run=run)
    )
    run.close()
    assert calls.n > 0, "the planted failure never fired"
    want_losses, want_params = reference
    assert losses == want_losses
    assert all(torch.equal(a, b) for a, b in zip(params, want_params, strict=True))
    assert handle.failures.counts == {spec.place: calls.n}
    err = capsys.readouterr().err
    assert err.count(f"{spec.place.replace('_', ' ')} failed") == 1
    assert "Injected('planted failure #1')" in err
    _, rows = RunStore(tmp_path / "run").query(
        "SELECT name, max(value) FROM metrics WHERE name IN "
        f"('monitors/self/errors_count', 'monitors/self/{spec.place}_errors_count') "
        "GROUP BY name"
    )
    assert dict(rows) == {
        "monitors/self/errors_count": calls.n,
        f"monitors/self/{spec.place}_errors_count": calls.n,
    }


@pytest.mark.parametrize("point", list(POINTS))
def test_strict_raises_the_failure_where_it_happened(point, monkeypatch):
    spec = POINTS[point]
    calls = Calls()
    model = _llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = _planted(spec, monkeypatch, calls, model, opt, strict=True)
    ids = _batches()[0]
    reached = "forward"
    with pytest.raises(Injected):
        with no_sync(cpu_as_device=True):
            loss = model(ids, labels=ids).loss
        reached = "optimizer"
        loss.backward()
        opt.step()
        reached = "step"
        handle.step(0)
        reached = "close"
        handle.close()
    assert reached == spec.raises_in and calls.n == 1
    handle.close()  # after a strict failure the hooks still come off


def test_failures_in_every_step_and_none_in_the_records_still_reach_the_run(monkeypatch, tmp_path):
    """A handle whose every flush fails builds no records: its count goes to the run at
    close, at the last step."""
    run = Run(run_dir=tmp_path / "run")
    calls = Calls()

    def make(model, opt):
        handle = attach(model, build("activations"), run=run, lagged=False, budget=None)
        monkeypatch.setattr(handle.metrics, "flush_landed", calls.fail)
        return handle

    _train(make)
    run.close()
    _, rows = RunStore(tmp_path / "run").query(
        "SELECT step, value FROM metrics WHERE name = 'monitors/self/errors_count'"
    )
    assert [tuple(r) for r in rows] == [(STEPS - 1, float(STEPS))]


def test_norms_with_an_optimizer_of_none_of_the_layers_is_refused_at_attach():
    from syncless.errors import UsageError

    model = _llama()
    head_only = torch.optim.SGD(model.lm_head.parameters(), lr=0.1)
    with pytest.raises(UsageError, match="none of them belongs to the 2 layers found"):
        attach(model, build("norms", optimizer=head_only))
    assert not any(m._forward_hooks for m in model.modules())  # nothing was left behind
