"""Kernel-launching aten ops each monitor adds per layer per step.

Counts the aten ops (views, allocations and scalar wrappers excluded) dispatched during
one demo training step (forward, backward,
optimizer step and the monitor flush) with a counting TorchDispatchMode, with one
monitor attached versus none, and divides the difference by the number of layers (each
monitor hooks one module per layer, norms its optimizer hooks; the flush's few ops are
included, amortised). Deterministic: no timing. On CUDA an aten op launches at least one
kernel (some launch more: topk, large reductions' memsets), so this is a lower bound
on the launches the issue's "at most 3 per hooked module" target counts.

    python -m bench.monitors ops
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from bench.harness import append_result
from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.monitors import MONITORS, attach, build

# Ops that only make a view, allocate, or wrap a Python scalar: no kernel on CUDA.
NO_KERNEL = {
    "aten.view", "aten._unsafe_view", "aten.detach", "aten.transpose", "aten.t",
    "aten.slice", "aten.select", "aten.expand", "aten.as_strided", "aten.unsqueeze",
    "aten.squeeze", "aten.permute", "aten.alias", "aten.split", "aten.unbind",
    "aten.split_with_sizes", "aten.empty", "aten.empty_like", "aten.empty_strided",
    "aten.promote_types", "aten.scalar_tensor", "aten.result_type", "aten.lift_fresh",
    "aten.new_empty",
}  # fmt: skip


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name not in NO_KERNEL:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def step_ops(monitor: str | None) -> tuple[int, int, Counter]:
    torch.manual_seed(0)
    cfg = preset("tiny", n_layers=4)
    model = MoETransformer(cfg)
    init_weights(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    handle = None
    if monitor is not None:
        handle = attach(model, build([monitor], optimizer=opt, every=1), lagged=True)
    tokens = torch.randint(0, 256, (2, 32))

    def one_step(step: int) -> None:
        logits, balance = model(tokens)
        (F.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + balance).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if handle is not None:
            handle.step(step)

    one_step(0)  # warm-up: lazy state, first flush
    counter = CountOps()
    with counter:
        one_step(1)
    if handle is not None:
        handle.close()
    return sum(counter.ops.values()), cfg.n_layers, counter.ops


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-record", action="store_true")
    args = parser.parse_args(argv)
    base, _, base_ops = step_ops(None)
    rows = []
    for name in MONITORS:
        total, hooked, ops = step_ops(name)
        extra = total - base
        diff = ops - base_ops
        rows.append((name, extra, hooked, extra / max(hooked, 1), diff.most_common(6)))
    print(f"baseline step: {base} aten ops (demo tiny, 4 layers)")
    print(f"{'monitor':<12}{'extra ops':>10}{'layers':>7}{'per layer':>10}  top ops")
    for name, extra, hooked, per, top in rows:
        print(f"{name:<12}{extra:>10}{hooked:>7}{per:>10.1f}  {top}")
    if args.no_record:
        return
    append_result(
        "monitor_ops",
        "kernel-launching aten ops added per layer per step, demo tiny 4 layers (forward+backward+optimizer+"
        "flush, counted): " + "; ".join(f"{n} {p:.1f}" for n, _, _, p, _ in rows),
    )
