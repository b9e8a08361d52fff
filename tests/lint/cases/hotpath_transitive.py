"""Functions called from hot functions are hot, with the argument types they get."""

import torch


def _peak(t):
    return t.abs().max()


def to_number(t):
    return float(t)  # expect: SL003


def stats(values, scale):
    if scale > 0:  # scale is a Python number at the only call site: fine
        pass
    return values.mean().item()  # expect: SL001


def only_cold_callers(t):
    return t.item()


class Base:
    def _shared(self, t):
        return t.tolist()  # expect: SL002


class Monitor(Base):
    def __init__(self, model):
        model.register_forward_hook(self._observe)
        self.buffer = torch.zeros(4)
        only_cold_callers(self.buffer)

    def _observe(self, module, inputs, output):
        peak = _peak(output)
        if peak > 0:  # expect: SL004
            pass
        to_number(output.sum())
        stats(output, 2)
        self._record(output)
        Monitor._static_helper(output)
        self._shared(output)
        helper = self._closure_factory()
        helper(output)

        def local(t):
            return t.cpu()  # expect: SL002

        local(output)
        return [inner(t) for t in inputs]

    def _record(self, value):
        if value.sum() > 0:  # expect: SL004
            self.buffer.add_(1)
        return self._deeper(value)

    def _deeper(self, value):
        return value.numpy()  # expect: SL002

    @staticmethod
    def _static_helper(t):
        print(t)  # expect: SL005

    def _closure_factory(self):
        def run(t):
            return t.item()  # expect: SL001

        return run

    def flush(self):
        # Cold: never called from a hook.
        return self.buffer.cpu()


def inner(t):
    return int(t.argmax())  # expect: SL003


def _apply(fn, value):
    return fn(value)


def tree_hook(module, inputs, output):
    def leaf(t):
        return t.cpu()  # expect: SL002

    return _apply(leaf, output)


def finish(t):
    # Runs at flush: hot code only stores it.
    return t.item()


def drain():
    return torch.zeros(1).item()


class Deferring:
    def __init__(self, model):
        self.pending = []
        model.register_forward_hook(self._defer)

    def _defer(self, module, inputs, output):
        import functools
        import threading

        self.pending.append(functools.partial(finish, output))
        self.pending.append(lambda: output.item())
        self.pending.append(self._later)
        threading.Thread(target=drain).start()
        return sorted(inputs, key=lambda t: t.sum().item())  # expect: SL001

    def _later(self):
        return self.pending[0].item()


class WithProperty:
    def __init__(self):
        self.total = torch.zeros(())

    @property
    def mean(self):
        return self.total.item() / 2  # expect: SL001

    @property
    def scale(self):
        return 2.0

    def grad_hook(self, grad):
        return grad * self.mean * self.scale

    def report(self):
        return self.total.cpu()
