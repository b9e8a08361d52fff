"""SL004: branching on a tensor value."""

import torch


class Clipper:
    def __init__(self, model):
        self.limit = torch.tensor(10.0)
        self.count = 0
        model.register_full_backward_hook(self._clip)

    def _clip(self, module, grad_input, grad_output):
        g = grad_output[0]
        if g.abs().max() > self.limit:  # expect: SL004
            pass
        if self.limit > 0:  # expect: SL004
            pass
        while g.norm() > 1:  # expect: SL004
            g = g / 2
        scale = 0.5 if g.isnan().any() else 1.0  # expect: SL004
        assert torch.isfinite(g).all()  # expect: SL004
        if not g.any():  # expect: SL004
            pass
        ok = g.sum() > 0 and self.count > 0  # expect: SL004
        top = max(g.max(), g.min())  # expect: SL004
        found = [t for t in grad_input if t.sum() > 0]  # expect: SL004
        anything = any(t.isnan().any() for t in grad_input)  # expect: SL004
        if g:  # expect: SL004
            pass
        # metadata and Python values: fine
        if g.shape[0] > 0 and g.dim() == 2 and g.numel():
            pass
        if g.dtype == torch.float16 or g.is_cuda or g.requires_grad:
            pass
        if grad_input:  # a tuple of tensors, not a tensor
            pass
        if g is None or self.count > 3:
            pass
        if isinstance(g, torch.Tensor) and len(grad_input) > 1:
            pass
        masked = torch.where(g > 0, g, 0)  # a comparison that is not a condition: fine
        biggest = torch.maximum(g, -g)
        return scale, ok, top, found, anything, masked, biggest


def cold(g):
    if g.sum() > 0:
        return g
    return None
