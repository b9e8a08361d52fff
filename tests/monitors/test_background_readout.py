"""``attach(..., background=True)``: decode, derives and records on a readout thread."""

from __future__ import annotations

import threading

import pytest
import torch

from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.guard import no_sync
from syncless.monitors import attach
from syncless.monitors.activations import ActivationsMonitor

STEPS = 5


def _model() -> MoETransformer:
    model = MoETransformer(preset("tiny"))
    init_weights(model, 0)
    return model


class _ThreadNoting(ActivationsMonitor):
    """Notes the thread each derive runs on."""

    def __init__(self) -> None:
        super().__init__(every=1)
        self.derive_threads: list[str] = []

    def derive(self, readout):
        self.derive_threads.append(threading.current_thread().name)
        return super().derive(readout)


def test_every_steps_values_arrive_in_order_from_the_readout_thread():
    model = _model()
    reference: list[list[torch.Tensor]] = []  # per step, per layer: the block output
    ref_hooks = [
        block.register_forward_hook(lambda m, a, out: reference[-1].append(out[0].detach().clone()))
        for block in model.layers
    ]
    monitor = _ThreadNoting()
    handle = attach(model, [monitor], background=True, budget=None)
    records = []
    for step in range(STEPS):
        reference.append([])
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
        with no_sync(cpu_as_device=True), torch.no_grad():
            model(tokens)
            records += list(handle.step(step))
    records += list(handle.close())
    for h in ref_hooks:
        h.remove()

    # Naive reference: each layer's largest |x| over every channel, per step.
    expected = {
        (step, f"monitors/layer_{layer:02d}/act_channel_absmax"): out.abs().max().item()
        for step, outs in enumerate(reference)
        for layer, out in enumerate(outs)
    }
    got = {(r.step, r.name): r.value for r in records if (r.step, r.name) in expected}
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-6), key
    steps = [r.step for r in records]
    assert steps == sorted(steps)  # emitted oldest first
    # The last step is flushed at close and read there, on the caller's thread.
    thread = "syncless-monitors-readout_0"
    assert monitor.derive_threads == [thread] * (STEPS - 1) + ["MainThread"]
    own = [r for r in records if r.name == "monitors/self/readout_host_ms"]
    assert len(own) == STEPS - 1 and all(r.value > 0 for r in own)
    assert handle.readout_host_ns_total > 0


def test_a_failing_readout_is_counted_not_raised_unless_strict(capsys):
    model = _model()
    tokens = torch.randint(0, 256, (2, 8))

    def broken(landed):
        raise ZeroDivisionError("a bug in decode")

    handle = attach(model, [ActivationsMonitor()], background=True, budget=None)
    handle.metrics.decode = broken  # type: ignore[method-assign]
    for step in range(3):
        with no_sync(cpu_as_device=True), torch.no_grad():
            model(tokens)
            handle.step(step)
    handle._collect(block=True)
    # Steps 0 and 1 went through the thread (step 2 waits for close, on this thread).
    assert handle.readout_errors == 2
    del handle.metrics.decode  # the class's again
    handle.close()
    assert "readout failed" in capsys.readouterr().err

    strict = attach(model, [ActivationsMonitor()], background=True, strict=True, budget=None)
    strict.metrics.decode = broken  # type: ignore[method-assign]
    with pytest.raises(ZeroDivisionError):
        for step in range(3):
            with no_sync(cpu_as_device=True), torch.no_grad():
                model(tokens)
                strict.step(step)
            strict._collect(block=True)  # the thread's failure, raised here
    for h in strict.ctx.handles:
        h.remove()


def test_background_defaults_to_cuda_only():
    model = _model()
    handle = attach(model, [ActivationsMonitor()], budget=None)
    assert handle._executor is None  # CPU: records come back from the step that reads them
    handle.close()


def test_the_readout_waits_for_the_next_backward():
    """A readout submitted at a flush runs once the next backward starts (the GIL is
    autograd's then), not during the next forward."""
    model = _model()
    monitor = _ThreadNoting()
    handle = attach(model, [monitor], background=True, budget=None)
    tokens = torch.randint(0, 256, (2, 16))

    def train_step():
        logits, balance = model(tokens)
        (logits.square().mean() + balance).backward()

    with no_sync(cpu_as_device=True):
        train_step()
        handle.step(0)
        train_step()
        handle.step(1)  # step 0's readout (lagged) is queued now, waiting
        (job,) = handle._inflight
        logits, balance = model(tokens)  # step 2's forward: still waiting
        assert not job.done() and monitor.derive_threads == []
        (logits.square().mean() + balance).backward()  # the signal
    readout, _ = job.result(timeout=10)
    assert readout.step == 0 and monitor.derive_threads == ["syncless-monitors-readout_0"]
    handle.close()


def test_a_handle_never_closed_does_not_hang_the_exit(tmp_path):
    """The readout thread waits for a backward with a timeout: the interpreter, which
    joins it at exit, gets out even when close() is never called."""
    import subprocess
    import sys

    script = tmp_path / "forgot_close.py"
    script.write_text(
        "import torch\n"
        "from syncless.demo.config import preset\n"
        "from syncless.demo.model import MoETransformer\n"
        "from syncless.monitors import attach\n"
        "from syncless.monitors.activations import ActivationsMonitor\n"
        "model = MoETransformer(preset('tiny'))\n"
        "handle = attach(model, [ActivationsMonitor()], background=True, budget=None)\n"
        "for step in range(3):\n"
        "    with torch.no_grad():\n"
        "        model(torch.randint(0, 256, (2, 8)))\n"
        "    handle.step(step)\n"
        "print('done')\n"
    )
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "done"


def test_each_steps_own_cost_rides_with_that_steps_values():
    """The hook ledger taken at step s's flush goes with step s's readout (which the
    readout thread gets one flush later), not with the step being flushed then."""
    model = _model()
    handle = attach(model, [ActivationsMonitor()], background=True, budget=None)
    tokens = torch.randint(0, 256, (2, 8))
    records = []
    for step in range(4):
        with no_sync(cpu_as_device=True), torch.no_grad():
            model(tokens)
        # a synthetic 10 (s + 1) s of hooks, far above the real ones (the interpreter's
        # included), so each step's bill is recognisable
        handle.ctx.host_ns["activations"] += (step + 1) * 10_000_000_000
        records += list(handle.step(step))
    records += list(handle.close())
    billed = {
        r.step: r.value for r in records if r.name == "monitors/self/activations_hook_host_ms"
    }
    assert sorted(billed) == [0, 1, 2, 3]
    for step, ms in billed.items():
        assert 10_000 * (step + 1) <= ms < 10_000 * (step + 1) + 5_000, (step, ms)
