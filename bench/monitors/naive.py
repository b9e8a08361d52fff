"""The same statistics the built-in monitors record, computed the obvious way.

One `.item()` per statistic inside the hook and one all_reduce per metric: the monitor
stack many teams write first. Only for bench/monitors/overhead.py, as the comparison
that puts the built-in monitors' cost in context. Not part of the library.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from syncless.monitors.adapters import ModelMap


def _reduce(value: float, op=None) -> float:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        t = torch.tensor(
            [value], device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
        )
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
        return t.item()
    return value


class NaiveMonitors:
    def __init__(self, model_map: ModelMap, thresholds=(20.0, 100.0, 500.0)) -> None:
        self.values: dict[str, float] = {}
        self.handles = []
        self.active = True
        self.thresholds = thresholds
        for site in model_map.layers:
            i = site.index
            if site.attention is not None:
                self.handles += site.attention.attach_qk(self._attention(i, site.attention))
            if site.router is not None:
                self.handles += site.router.attach_logits(self._router(i, site.router))
            self.handles += site.attach_output(self._output(i))

    def _attention(self, i, att):
        def hook(q, k):
            if not self.active:
                return
            k = k.repeat_interleave(att.n_heads // att.n_kv_heads, dim=1)
            logits = (q.float() @ k.float().transpose(-1, -2)) * att.scale
            if att.causal:
                n = logits.shape[-1]
                mask = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
                logits = logits.masked_fill(mask, float("-inf"))
            p = logits.softmax(-1)
            ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)
            for h in range(att.n_heads):
                self.values[f"l{i}/h{h}/qk_max"] = _reduce(
                    logits[:, h].max().item(), dist.ReduceOp.MAX
                )
                self.values[f"l{i}/h{h}/entropy"] = _reduce(ent[:, h].mean().item())

        return hook

    def _router(self, i, router):
        def hook(logits):
            if not self.active:
                return
            probs = logits.float().softmax(-1)
            top = probs.topk(router.top_k, dim=-1)
            counts = torch.bincount(top.indices.flatten(), minlength=router.n_experts).tolist()
            for e, c in enumerate(counts):
                self.values[f"l{i}/e{e}/tokens"] = _reduce(float(c))
            mean = sum(counts) / len(counts)
            self.values[f"l{i}/imbalance"] = max(counts) / mean if mean else 0.0
            self.values[f"l{i}/zloss"] = _reduce(
                logits.float().logsumexp(-1).square().mean().item()
            )
            self.values[f"l{i}/topk_mass"] = _reduce(top.values.sum(-1).mean().item())

        return hook

    def _output(self, i):
        def hook(hidden):
            if not self.active:
                return
            absmax = hidden.abs().flatten(0, -2).amax(0)
            self.values[f"l{i}/act_absmax"] = _reduce(absmax.max().item(), dist.ReduceOp.MAX)
            self.values[f"l{i}/act_median"] = absmax.median().item()
            for t in self.thresholds:
                self.values[f"l{i}/above_{t}"] = _reduce(float((absmax > t).sum().item()))
            self.values[f"l{i}/nonfinite"] = _reduce(float((~torch.isfinite(hidden)).sum().item()))

        return hook

    def norms(self, model) -> None:
        """Per-parameter norms with one `.item()` each, after the step."""
        for name, p in model.named_parameters():
            self.values[f"{name}/norm"] = _reduce(p.norm().item())
            if p.grad is not None:
                self.values[f"{name}/grad_norm"] = _reduce(p.grad.norm().item())

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
