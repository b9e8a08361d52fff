"""The monitor stack bills its own host time: per monitor and in total, per flush."""

from __future__ import annotations

import time

import torch

from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.guard import no_sync
from syncless.metrics import MetricSet
from syncless.monitors import attach, build
from syncless.monitors.base import MonitorContext


def test_timed_bills_the_hook_and_passes_values_through():
    ctx = MonitorContext(model=None, metrics=MetricSet())  # type: ignore[arg-type]

    def slow(x, *, scale):
        time.sleep(0.02)
        return x * scale

    billed = ctx.timed("m", slow)
    start = time.perf_counter_ns()
    assert billed(3, scale=2) == 6
    wall = time.perf_counter_ns() - start
    assert 20e6 <= ctx.host_ns["m"] <= wall  # the sleep is inside, nothing outside is


def test_records_carry_each_monitors_hook_time_and_the_total():
    model = MoETransformer(preset("tiny"))
    init_weights(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)  # no .item() inside
    names = ["attention", "moe", "activations", "nonfinite", "norms"]
    handle = attach(model, build(names, optimizer=opt, every=1), lagged=False)
    tokens = torch.randint(0, 256, (2, 16))
    for step in range(2):
        with no_sync(cpu_as_device=True):
            logits, balance = model(tokens)
            (logits.square().mean() + balance).backward()
            opt.step()
            opt.zero_grad()
        records = {r.name: r.value for r in handle.step(step)}
        per_monitor = [records[f"monitors/self/{n}_hook_host_ms"] for n in names]
        assert all(ms > 0 for ms in per_monitor)
        assert abs(records["monitors/self/hook_host_ms"] - sum(per_monitor)) < 1e-9
    totals = handle.hook_host_ns_total
    assert set(totals) == set(names) and all(ns > 0 for ns in totals.values())
    handle.close()
