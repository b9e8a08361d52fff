"""Hot-path discovery by name and decorator, and what stays cold."""

import torch

import syncless
from syncless import hot_path as hp


def activation_hook(module, inputs, output):
    return output.item()  # expect: SL001


def _compute_peak(x):
    return x.abs().max().item()  # expect: SL001


class Tracker:
    def _grad_hook(self, grad):
        if grad.norm() > 1:  # expect: SL004
            return grad.item()  # expect: SL001
        return None

    def _compute_norms(self, output):
        return float(output.norm())  # expect: SL003

    def _make_attn_hook(self, layer):
        # The factory runs once, at registration: cold, although its name ends in _hook.
        scale = torch.ones(1).item()

        def hook(module, inputs, output):
            return output.max().item() * scale + layer  # expect: SL001

        return hook

    def install_hook(self, model):
        # It registers hooks, so it is registration code: cold despite its name.
        seen = torch.zeros(1).item()
        model.register_forward_hook(self._make_attn_hook(0))
        return seen

    def attention_hook(self, name):
        # Hot by name, but it returns its own closure: a factory, so cold itself.
        warmup = torch.zeros(1).item()

        def inner(module, inputs, output):
            return output.item() + warmup  # expect: SL001

        return inner


@hp
def step(batch):
    return batch.sum().item()  # expect: SL001


@syncless.hot_path
def record(x: torch.Tensor) -> None:
    if x.max() > 0:  # expect: SL004
        pass


def hook_count(model):
    # Does not match `*_hook`: cold.
    return torch.zeros(1).item()


def cold_compute(x):
    return x.item()
