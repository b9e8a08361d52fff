"""Helpers of the integration tests: load an example script, and the ground truth of a
layer's norms at an optimizer step."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import torch

EXAMPLES = Path(__file__).parents[2] / "examples"


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record_layer_norms(layer: torch.nn.Module, optimizer: torch.optim.Optimizer, out: list):
    """A pre-step hook on ``optimizer`` (registered after syncless's, so it sees what the
    norms monitor sees: after clipping, before the update) that appends ``layer``'s
    (parameter norm, gradient norm) in float64 to ``out`` at every optimizer step."""

    def pre_step(opt, args, kwargs):
        params = torch.cat([p.detach().double().flatten() for p in layer.parameters()])
        grads = torch.cat([p.grad.double().flatten() for p in layer.parameters()])
        out.append((params.norm().item(), grads.norm().item()))

    optimizer.register_step_pre_hook(pre_step)


def assert_layer_norms(run_dir, truth: list[tuple[float, float]]) -> None:
    """The run's ``monitors/layer_00/{param,grad}_norm`` at every step that has them (at
    least one: the budget sets how often) equal ``truth[step]`` to 1e-5."""
    import math

    from syncless.run import open as open_run

    with open_run(run_dir) as store:
        _, rows = store.query(
            "SELECT step, name, value FROM metrics WHERE name IN "
            "('monitors/layer_00/param_norm', 'monitors/layer_00/grad_norm') ORDER BY step"
        )
    got = {(step, name.rsplit("/", 1)[1]): value for step, name, value in rows}
    steps = sorted({step for step, _ in got})
    assert steps
    for step in steps:
        param, grad = truth[step]
        assert math.isclose(got[step, "param_norm"], param, rel_tol=1e-5)
        assert math.isclose(got[step, "grad_norm"], grad, rel_tol=1e-5)


class NanFrom:
    """A forward pre-hook that puts NaN into ``layer``'s input from optimizer step
    ``at`` on (``step`` is advanced by the framework's callback): the layer's output,
    the loss and everything after go nonfinite, as in a diverged run."""

    def __init__(self, layer: torch.nn.Module, at: int) -> None:
        self.at, self.step = at, 0
        layer.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        if self.step < self.at:
            return None
        x = args[0].clone()
        x[..., 0] = float("nan")
        return (x, *args[1:])


def handed_over(monkeypatch) -> dict[int, tuple[float | None, float | None]]:
    """What ``MonitorHandle.step`` is given at each step, ``{step: (loss, grad_norm)}``,
    read to the host here (None where a value was not given)."""
    from syncless.monitors import MonitorHandle

    given: dict[int, tuple[float | None, float | None]] = {}
    step = MonitorHandle.step

    def recorded(self, at, *args, loss=None, grad_norm=None, **kwargs):
        given[at] = (None if loss is None else float(loss),
                     None if grad_norm is None else float(grad_norm))  # fmt: skip
        return step(self, at, *args, loss=loss, grad_norm=grad_norm, **kwargs)

    monkeypatch.setattr(MonitorHandle, "step", recorded)
    return given
