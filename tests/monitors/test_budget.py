"""The overhead budget: cadences by water-filling, and the handle applying them."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.guard import no_sync
from syncless.monitors import attach, build
from syncless.monitors.budget import AGREE_EVERY, GROWTH, MAX_EVERY, PLANNED, Budget, plan
from syncless.testing import spawn_gloo


def test_plan_shares_the_budget_out_by_water_filling():
    # Worked by hand: three monitors, 1% of the step. b needs 0.1% at every step, under
    # its third (0.333%): it keeps every 1 and leaves 0.9% to two. a's half is 0.45%:
    # every ceil(2 / 0.45) = 5 costs 0.4%, leaving 0.5% to c: every ceil(5 / 0.5) = 10.
    costs = {"a": 0.02, "b": 0.001, "c": 0.05}
    every = plan(costs, {"a": 1, "b": 1, "c": 1}, 0.01)
    assert every == {"a": 5, "b": 1, "c": 10}
    assert sum(costs[m] / every[m] for m in costs) <= 0.01


def test_plan_keeps_the_fastest_cadence_and_unmeasured_monitors():
    every = plan({"norms": 0.05}, {"norms": 10, "attention": 1}, 0.01)
    assert every == {"norms": 10, "attention": 1}  # 0.5% at every 10 fits; no cost yet
    assert plan({"norms": 0.5}, {"norms": 10}, 0.01) == {"norms": 50}
    assert plan({"x": 100.0}, {"x": 1}, 0.01) == {"x": MAX_EVERY}  # cannot fit: capped


@pytest.mark.parametrize("seed", range(20))
def test_plan_fits_the_budget_whenever_the_cap_allows(seed):
    g = torch.Generator().manual_seed(seed)
    names = "abcde"
    costs = {m: float(c) for m, c in zip(names, torch.rand(5, generator=g) * 0.2, strict=True)}
    fastest = {
        m: int(f) for m, f in zip(names, torch.randint(1, 4, (5,), generator=g), strict=True)
    }
    every = plan(costs, fastest, 0.01)
    assert all(every[m] >= fastest[m] for m in names)
    assert sum(costs[m] / every[m] for m in names) <= 0.01 * (1 + 1e-9)


def fake_clock(period_s: float):
    ticks = itertools.count()
    return lambda: next(ticks) * period_s


def test_budget_sets_the_cadence_from_host_cost_and_step_time_on_cpu():
    budget = Budget(0.01, {"slow": 1, "cheap": 1}, "cpu")
    budget.clock = fake_clock(0.020)  # a 20 ms step
    # the first active step compiles (not measured), then 2 ms and 0.02 ms of hooks
    budget.step_end(["slow", "cheap"], {"slow": 900_000_000, "cheap": 900_000_000})
    for _ in range(5):
        budget.step_end(["slow", "cheap"], {"slow": 2_000_000, "cheap": 20_000})
    # PLANNED of 1% is shared out (the rest is headroom): cheap, 0.1% at every step,
    # fits its half; slow gets the rest, every ceil(10% / (0.6% - 0.1%)) = 20 steps
    planned = 0.01 * PLANNED
    slow_every = math.ceil(0.1 / (planned - 0.001))
    assert slow_every == 20 and budget.cadence == {"slow": slow_every, "cheap": 1}
    records = budget.records("monitors")
    assert records["monitors/self/slow_every_steps"] == 20
    assert records["monitors/self/step_ms"] == pytest.approx(20.0)
    assert records["monitors/self/stack_share_frac"] == pytest.approx(0.1 / 20 + 0.001)
    assert "budget 1.0% of a 20.0 ms step" in budget.summary()


def test_the_flush_is_billed_to_the_monitors_that_made_it():
    """A monitor whose hooks cost nothing (moe on a dense model) still forces a flush
    at each of its active steps: the flush's host time is its cost."""
    budget = Budget(0.01, {"free": 1, "other": 1}, "cpu")
    budget.clock = fake_clock(0.020)
    for _ in range(4):
        budget.step_end(["free"], {"free": 0}, flush_ms=2.0)
    assert budget.cost_ms["free"] == 2.0
    assert budget.cadence["free"] == math.ceil(0.1 / (0.01 * PLANNED))  # 14
    budget.step_end(["free", "other"], {"free": 0, "other": 0}, flush_ms=2.0)
    assert "other" not in budget.cost_ms  # its first active step is not measured
    budget.step_end(["free", "other"], {"free": 0, "other": 0}, flush_ms=2.0)
    assert budget.cost_ms["other"] == 1.0  # half of a flush both made


def test_a_cadence_grows_at_most_fourfold_per_measurement():
    budget = Budget(0.01, {"m": 1}, "cpu")
    budget.clock = fake_clock(0.010)
    seen = []
    for step in range(200):  # 100% of a 10 ms step: it wants every 167 steps
        active = ["m"] if step % budget.cadence["m"] == 0 else []
        budget.step_end(active, {"m": 10_000_000})
        if active:
            seen.append((step, budget.cadence["m"]))
    want = math.ceil(1.0 / (0.01 * PLANNED))
    assert want == 167
    # the first active step is not measured; each later one lets the cadence grow 4x
    assert seen == [(0, 1), (1, GROWTH), (4, GROWTH**2), (16, GROWTH**3), (64, want), (167, want)]


def test_a_costly_outlier_does_not_stall_a_monitor():
    """A recompile or an allocator stall once: the median of the window ignores it."""
    budget = Budget(0.01, {"m": 1}, "cpu")
    budget.clock = fake_clock(0.100)
    for host_ms in [0.0, 0.5, 0.5, 800.0, 0.5, 0.5]:
        budget.step_end(["m"], {"m": int(host_ms * 1e6)})
    assert budget.cost_ms["m"] == 0.5 and budget.cadence["m"] == 1


def _agreeing_rank(rank: int, world: int) -> list[dict[str, int]]:
    budget = Budget(0.01, {"attention": 1, "norms": 10}, "cpu")
    budget.clock = fake_clock(0.100)
    # rank 1's attention costs 4x rank 0's; its norms half: each rank plans otherwise
    attention_ns = [1_000_000, 4_000_000][rank]
    norms_ns = [8_000_000, 4_000_000][rank]
    seen = []
    for step in range(2 * AGREE_EVERY):
        budget.step_end(["attention", "norms"], {"attention": attention_ns, "norms": norms_ns})
        budget.agree(step + 1)
        seen.append(dict(budget.cadence))
    return [seen[0], seen[AGREE_EVERY - 1], dict(budget.proposed)]


@pytest.mark.dist
def test_ranks_agree_on_the_slowest_cadence_at_the_same_step():
    (before0, after0, mine0), (before1, after1, mine1) = spawn_gloo(_agreeing_rank, 2)
    assert mine0 != mine1  # each rank alone would have chosen other cadences
    assert before0 == before1 == {"attention": 1, "norms": 10}  # nothing agreed at step 1
    slowest = {m: max(mine0[m], mine1[m]) for m in mine0}
    assert after0 == after1 == slowest


def test_a_budget_outside_zero_and_one_is_refused():
    with pytest.raises(ValueError, match="fraction of the step"):
        Budget(1.0, {"a": 1}, "cpu")


def test_the_handle_runs_each_monitor_at_the_budgets_cadence():
    cfg = preset("tiny")
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    init_weights(model, 0)
    handle = attach(model, build("activations", every=1), lagged=False, budget=0.01)
    handle.budget.clock = fake_clock(0.001)  # a 1 ms step: any hook is over 1% of it
    tokens = torch.randint(0, 256, (2, 16))
    recorded, cadence, billed = [], [], {}
    for step in range(8):
        cadence.append(handle.cadences["activations"])
        with no_sync(cpu_as_device=True), torch.no_grad():
            model(tokens)
        records = {r.name: r.value for r in handle.step(step)}
        recorded.append("monitors/layer_00/act_absmax" in records)
        billed.update(records)
    handle.close()
    # every in force at each step decides it; step 0 runs at the fastest cadence
    assert recorded == [s % e == 0 for s, e in zip(range(8), cadence, strict=True)]
    assert cadence[0] == 1 and max(cadence) > 1  # measured once, then slowed down
    # the cadence the flush recorded is one the steps ran at
    assert billed["monitors/self/activations_every_steps"] in cadence
    assert billed["monitors/self/budget_frac"] == 0.01


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_spans_measure_the_hooks_kernels_without_a_sync():
    """A hook that enqueues a known spin (torch.cuda._sleep) on a busy stream: the span
    measures it, timed independently by an event pair around the same spin."""
    cycles = 4_000_000
    torch.cuda._sleep(cycles)  # its first launch loads the kernel: not in the reference
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(cycles)
    b.record()
    b.synchronize()
    spin_ms = a.elapsed_time(b)

    budget = Budget(0.01, {"m": 1}, "cuda")
    budget.step_end(["m"], {"m": 0})  # its first active step compiles: never timed
    budget.arm(["m"])
    assert budget.timing == {"m"}
    torch.cuda._sleep(cycles * 5)  # the device is behind the host, as in a real step
    with no_sync():
        span = budget.begin()
        torch.cuda._sleep(cycles)
        budget.end("m", span)
        budget.step_end(["m"], {"m": 0})  # the GPU has not got there: nothing read yet
    assert "m" not in budget.device_ms
    torch.cuda.synchronize()
    budget.step_end([], None)
    assert budget.device_ms["m"] == pytest.approx(spin_ms, rel=0.1)
    assert budget.cost_ms["m"] == pytest.approx(spin_ms, rel=0.1)
