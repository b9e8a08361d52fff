"""The budget's costs for monitors whose hooks run in compiled graphs (issue #20).

Such hooks leave nothing on their ledger (a clock read would break the graph). A
simulated training loop pays known costs per active monitor in its step time, with
noise; the budget must find those costs from step times alone and fit the cadences
to the budget. Ground truth: the costs the simulation injected.
"""

from __future__ import annotations

import random

import pytest

from syncless.monitors.budget import CHAIN_ORDER, Budget
from syncless.monitors.budget_compiled import StepDeltas

BASE_MS = 100.0
COMPILED = {"attention": 4.0, "moe": 0.5, "activations": 1.0}  # ms per active step
EAGER = {"norms": 3.0}  # its hooks are billed on their ledger, as in eager mode
NOISE_MS = 0.3  # each step's time is off by up to this much
# A set's cost is a median of 5 steps less the baseline's median of 5: off by up to the
# noise's amplitude (at most 0.32 ms over 6 seeds and run lengths of 400 to 1600 steps).
FOUND_WITHIN_MS = NOISE_MS + 0.1


def _simulate(steps: int, seen: set | None = None) -> Budget:
    fastest = dict.fromkeys(COMPILED, 1) | {"norms": 10}
    budget = Budget(0.01, fastest, "cpu")
    now = [0.0]
    budget.clock = lambda: now[0]
    budget.aligned = True  # a hook was traced by torch.compile
    noise = random.Random(0)
    for step in range(steps):
        active = [m for m, every in budget.cadence.items() if step % every == 0]
        if seen is not None:
            seen.add(frozenset(m for m in active if m in COMPILED))
        ms = BASE_MS + noise.uniform(-NOISE_MS, NOISE_MS)
        ms += sum(COMPILED.get(m, 0.0) + EAGER.get(m, 0.0) for m in active)
        now[0] += ms / 1e3
        host_ns = {m: int(EAGER[m] * 1e6) for m in active if m in EAGER}
        budget.step_end(active, host_ns)
    return budget


def test_compiled_monitors_are_billed_from_step_times_and_fit_the_budget():
    budget = _simulate(800)
    assert budget.compiled == set(COMPILED)
    for m, cost in COMPILED.items():
        assert budget.cost_ms[m] == pytest.approx(cost, abs=FOUND_WITHIN_MS), (m, budget.cost_ms)
    assert budget.cost_ms["norms"] == pytest.approx(EAGER["norms"])
    every = budget.cadence
    assert all(e & (e - 1) == 0 for e in every.values()), every
    assert all(every[m] >= 2 for m in COMPILED), every  # a baseline every other step
    true_share = sum(cost / every[m] for m, cost in (COMPILED | EAGER).items()) / BASE_MS
    assert true_share <= budget.fraction, (true_share, every)
    assert every["attention"] >= 8  # 4 ms of a 100 ms step cannot run often in 1%


def test_the_active_sets_are_prefixes_of_one_order_for_the_whole_run():
    """Each set is one compiled graph: prefixes of a fixed order keep them at monitors
    + 1 (orders that followed the estimates hit dynamo's recompile limit)."""
    seen: set = set()
    _simulate(800, seen)
    order = [m for m in CHAIN_ORDER if m in COMPILED]
    prefixes = {frozenset(order[:i]) for i in range(len(order) + 1)}
    assert seen <= prefixes, seen


def test_each_step_up_the_chain_is_split_among_the_monitors_it_adds():
    deltas = StepDeltas()
    steps = {frozenset(): 100.0, frozenset({"a"}): 103.0, frozenset({"a", "b", "c"}): 107.0}
    out = {}
    for _ in range(3):
        for active, ms in steps.items():
            out = deltas.add(ms, active) or out
    assert out == {"a": 3.0, "b": 2.0, "c": 2.0}
    # not before the baseline has its steps
    fresh = StepDeltas()
    assert not any(fresh.add(103.0, frozenset({"a"})) for _ in range(5))
