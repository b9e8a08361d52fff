"""On a GPU: the attention monitor's Triton kernel on Megatron's q/k (views of
``[s, b, heads, d]`` tensors, permuted) against a float64 softmax of the same tensors.

The CPU tests check the adapter against an independent recount through the torch path;
the kernel only runs on CUDA, so this checks it on the layout Megatron hands over.

    python bench/megatron_check.py
"""

from __future__ import annotations

from dataclasses import replace

import torch
from stack_models import MEGATRON, build_megatron

from syncless.monitors import attach, build
from syncless.monitors.adapters import find_layers


def naive(q: torch.Tensor, k: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) * scale
    allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    logits = logits.masked_fill(~allowed, -torch.inf)
    p = logits.softmax(-1)
    entropy = -torch.where(allowed, p * p.clamp_min(1e-300).log(), 0.0).sum(-1)
    return logits.amax(dim=(0, 2, 3)), entropy.mean(dim=(0, 2))


def main() -> None:
    spec = replace(MEGATRON, layers=2, batch=2, seq_len=1024)
    work = build_megatron(spec, torch.device("cuda"))
    captured = {}
    handles = []
    for site in find_layers(work.model).attention:
        handles += site.attach_qk(lambda q, k, i=site.layer: captured.__setitem__(i, (q, k)))
    handle = attach(work.model, build("attention"), lagged=False, budget=None)
    with torch.no_grad():
        work.loss()
    records = handle.step(0)
    readout = handle.readouts[-1]
    handle.close()
    for h in handles:
        h.remove()
    scale = find_layers(work.model).attention[0].scale
    worst = 0.0
    for layer, (q, k) in captured.items():
        top, entropy = naive(q, k, scale)
        got_top = torch.as_tensor(readout.get(f"monitors/layer_{layer:02d}/attn_qk_logit_max"))
        got_ent = torch.as_tensor(readout.get(f"monitors/layer_{layer:02d}/attn_entropy_nats"))
        err = max(
            float(((got_top - top.cpu()).abs() / top.cpu().abs()).max()),
            float(((got_ent - entropy.cpu()).abs() / entropy.cpu().abs()).max()),
        )
        worst = max(worst, err)
        print(f"layer {layer}: q {tuple(q.shape)} strides {q.stride()}, max rel err {err:.2e}")
    print(f"records {len(records)}; worst relative error {worst:.2e} (bf16 q/k, fp32 kernel)")
    assert worst < 2e-2, worst


if __name__ == "__main__":
    main()
