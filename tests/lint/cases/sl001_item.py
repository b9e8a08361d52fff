"""SL001: `.item()` on the hot path, in every shape; and where it is fine."""

import functools

import torch
import torch.nn as nn

import syncless
from syncless import hot_path


def forward_hook(module, inputs, output):
    return output.item()  # expect: SL001


def chained(module, inputs, output):
    value = output.abs().max().item()  # expect: SL001
    return value


def alias(module, inputs, output):
    t = output.max()
    return t.item()  # expect: SL001


def attach(model: nn.Module) -> None:
    model.register_forward_hook(chained)
    model.register_forward_hook(alias)
    model.register_forward_hook(lambda m, i, o: o.sum().item())  # expect: SL001
    for p in model.parameters():
        p.register_hook(lambda g: g.norm().item())  # expect: SL001


class Monitor:
    def __init__(self, model):
        self.peak = torch.zeros(())
        for i, layer in enumerate(model.layers):
            layer.register_forward_hook(self._record)
            layer.register_forward_hook(self._make_layer(i))
            layer.register_forward_pre_hook(functools.partial(self._pre, i))

    def _record(self, module, inputs, output):
        self.peak = torch.maximum(self.peak, output.abs().max())
        return self.peak.item()  # expect: SL001

    def _make_layer(self, index):
        # Runs once, at registration: not hot.
        first = torch.zeros(1).item()

        def hook(module, inputs, output):
            return output[0].item() + index + first  # expect: SL001

        return hook

    def _pre(self, index, module, inputs):
        return inputs[0].item()  # expect: SL001

    def report(self):
        # Cold: the user calls it at flush, no hook does.
        return self.peak.item()


@hot_path
def step_stats(x):
    return x.mean().item()  # expect: SL001


@syncless.hot_path
def step_stats_multiline(x):
    value = (
        x.abs()
        .max()
        .item()  # expect: SL001
    )
    return value


def cold(x):
    return x.item()


def quiet_hook(module, inputs, output):
    return output.sum()  # stays a tensor: fine
