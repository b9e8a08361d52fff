"""Hot-path discovery through hook registration: every shape of hook argument."""

import functools
from functools import partial

import torch
import torch.nn.modules.module as module_hooks
from torch.nn.modules.module import register_module_forward_hook


def plain(module, inputs, output):
    return output.item()  # expect: SL001


def with_state(state, module, inputs, output):
    return output.item() + state  # expect: SL001


def keyword_state(module, inputs, output, *, scale):
    return output.item() * scale  # expect: SL001


def make(index):
    # A factory with an ordinary name: cold; what it returns is the hook.
    warm = torch.zeros(1).item()

    def inner(module, inputs, output):
        return output.item() + index + warm  # expect: SL001

    return inner


def make_twice(index):
    return make(index)


def module_level_target(module, inputs, output):
    return output.item()  # expect: SL001


def module_level_backward(module, grad_input, grad_output):
    return grad_output[0].item()  # expect: SL001


class CallableHook:
    def __init__(self, name):
        self.name = name

    def __call__(self, module, inputs, output):
        return output.item()  # expect: SL001


class Monitor:
    def __init__(self, model):
        self.handles = [
            model.register_forward_hook(plain),
            model.register_forward_hook(functools.partial(with_state, 1)),
            model.register_forward_hook(partial(keyword_state, scale=2.0)),
            model.register_forward_hook(make(0)),
            model.register_forward_hook(make_twice(1)),
            model.register_forward_hook(CallableHook("x")),
            model.register_forward_hook(hook=self._by_keyword),
            model.register_forward_hook(self._with_kwargs, with_kwargs=True),
            model.register_forward_pre_hook(self._pre),
            model.register_full_backward_pre_hook(self._backward_pre),
            model.weight.register_post_accumulate_grad_hook(self._accumulated),
        ]
        aliased = self._aliased
        model.register_forward_hook(aliased)
        register_module_forward_hook(module_level_target)
        module_hooks.register_module_full_backward_hook(module_level_backward)
        torch.autograd.graph.register_multi_grad_hook([model.weight], self._multi)

    def _by_keyword(self, module, inputs, output):
        return output.item()  # expect: SL001

    def _with_kwargs(self, module, args, kwargs, output):
        if output.sum() > 0:  # expect: SL004
            return output.item()  # expect: SL001
        return None

    def _pre(self, module, inputs):
        return inputs[0].item()  # expect: SL001

    def _backward_pre(self, module, grad_output):
        return grad_output[0].item()  # expect: SL001

    def _accumulated(self, param):
        return float(param.grad.norm())  # expect: SL003

    def _aliased(self, module, inputs, output):
        return output.item()  # expect: SL001

    def _multi(self, grads):
        return [float(g.sum()) for g in grads]  # expect: SL003

    def not_registered(self, x):
        # Never registered, never called from a hook: cold.
        return x.item()


def cold(x):
    return x.item()


model = torch.nn.Linear(2, 2)
model.register_forward_hook(lambda m, i, o: o.item())  # expect: SL001
model.weight.register_hook(lambda grad: bool(grad.isnan().any()))  # expect: SL003
