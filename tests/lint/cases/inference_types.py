"""Type inference: what counts as a tensor for the type-dependent rules."""

import torch


class Stats:
    scale: torch.Tensor

    def __init__(self):
        self.total = torch.zeros(())
        self.steps = 0
        self.last = None
        self.register_buffer("peak", torch.zeros(()))

    def _hook(self, module, inputs, output):
        x, y = output, output.shape
        if x.sum() > 0:  # expect: SL004
            pass
        if y[0] > 1:
            pass
        a, b = output.max(dim=0)
        if a.sum() > 0:  # expect: SL004
            pass
        first, *rest = inputs
        if first.any():  # expect: SL004
            pass
        values = output.max(dim=1).values
        n = int(values.sum())  # expect: SL003
        t = output if self.steps else output * 2
        if t.mean() > 0:  # expect: SL004
            pass
        total = self.total + output.sum()
        if total > 0:  # expect: SL004
            pass
        if self.peak > 0:  # expect: SL004
            pass
        if self.scale > 0:  # expect: SL004
            pass
        if self.steps > 10 or self.last is None:
            pass
        z = output.sum() if self.steps else 0  # a tensor or an int: unsure, so no finding below
        if z > 0:
            pass
        self.steps += 1
        count = output.numel() + output.size(0) + output.dim() + len(inputs)
        if count > 0:
            pass
        for _i, item in enumerate(inputs):
            if item.mean() > 0:  # expect: SL004
                pass
        for u, _v in zip(inputs, inputs):
            print(u)  # expect: SL005
        w = output.detach().float().clamp(min=0).sqrt() @ output.T
        print(w)  # expect: SL005
        m = output.shape[-1] * 2.0 / 3
        print(m, output.dtype, output.device)
        if (k := output.sum()) > 0:  # expect: SL004
            pass
        return n, b, rest, k
