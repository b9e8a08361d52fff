"""Spike alarms on the loss and the gradient norm, checked on the device (issue #46).

Ground truth: a plain Python reference of the rule (the last ``window`` finite values
that were not spikes, their mean and population standard deviation), run over the same
series; and, end to end, steps whose loss the test itself multiplied.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from syncless.guard import no_sync
from syncless.metrics import MetricSet
from syncless.monitors import SpikeError, SpikeEvent, attach
from syncless.monitors.nonfinite import NonFiniteMonitor
from syncless.monitors.spikes import SpikeRule, ValueSpikes


def _reference(series: list[float], rule: SpikeRule) -> list[int]:
    """Indices the rule calls spikes, in plain Python."""
    kept: list[float] = []
    spikes = []
    for i, x in enumerate(series):
        if not math.isfinite(x):
            continue
        window = kept[-rule.window :]
        if len(window) >= rule.warmup:
            mean = statistics.fmean(window)
            std = statistics.pstdev(window)
            if x > mean + rule.sigmas * std and x > mean + rule.min_rel * abs(mean):
                spikes.append(i)
                continue
        kept.append(x)
    return spikes


def _series(n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    out = [2.0 + 0.5 * math.exp(-i / 40) + rng.gauss(0, 0.02) for i in range(n)]
    for i in (45, 46, 90, 140, 141, 142):  # spikes, one after another too
        out[i] *= rng.choice([1.5, 3.0, 10.0])
    out[60] = float("nan")  # the nonfinite alarm's, never a spike
    out[61] = float("inf")
    return out


@pytest.mark.parametrize("rule", [SpikeRule(), SpikeRule(window=16, warmup=8, sigmas=4.0)])
def test_the_device_check_calls_the_spikes_the_rule_calls(rule):
    series = _series(200, seed=1)
    ms = MetricSet()
    count = ms.declare("monitors", "loss_spike_count", "sum")
    first = ms.declare("monitors", "loss_spike_first_step", "min")
    ms.allocate("cpu")
    spikes = ValueSpikes(ms, count, first, rule)
    expected = _reference(series, rule)
    found = []
    with no_sync(cpu_as_device=True):
        for i, x in enumerate(series):
            ms.set_step_label(i)
            spikes.update(torch.tensor(x, dtype=torch.float32).double())
            (r,) = ms.flush(i, wait=True)
            if r.get("monitors/step/loss_spike_count")[0] > 0:
                assert r.get("monitors/step/loss_spike_first_step")[0] == i
                found.append(i)
    assert found == expected
    assert {45, 90, 140} <= set(expected)  # the planted ones are caught


def test_counts_and_the_first_step_add_up_between_readouts():
    rule = SpikeRule(window=32, warmup=8)
    series = _series(200, seed=2)
    expected = _reference(series, rule)
    ms = MetricSet()
    count = ms.declare("monitors", "loss_spike_count", "sum")
    first = ms.declare("monitors", "loss_spike_first_step", "min")
    ms.allocate("cpu")
    spikes = ValueSpikes(ms, count, first, rule)
    readouts = []
    with no_sync(cpu_as_device=True):
        for i, x in enumerate(series):
            ms.set_step_label(i)
            spikes.update(torch.tensor(x, dtype=torch.float64))
            if i % 25 == 24:
                readouts += ms.flush(i, wait=True)
    for r in readouts:
        window = [s for s in expected if r.step - 24 <= s <= r.step]
        assert r.get("monitors/step/loss_spike_count")[0] == len(window)
        if window:
            assert r.get("monitors/step/loss_spike_first_step")[0] == window[0]


def test_rules_refuse_what_cannot_work():
    with pytest.raises(ValueError, match="warmup"):
        SpikeRule(window=8, warmup=9)
    with pytest.raises(ValueError, match="sigmas"):
        SpikeRule(sigmas=0.0)


transformers = pytest.importorskip("transformers")


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config)


def _train(handle, model, steps: int, loss_scale: dict[int, float]) -> list:
    """SGD steps; the loss handed to ``handle.step`` is multiplied at the given steps
    (the model trains on the true loss)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    records = []
    for step in range(steps):
        ids = torch.randint(0, 64, (2, 8), generator=gen)
        with no_sync(cpu_as_device=True):
            loss = model(ids, labels=ids).loss
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
            opt.step()
            opt.zero_grad()
            seen = loss.detach() * loss_scale.get(step, 1.0)
        records += handle.step(step, loss=seen, grad_norm=grad_norm)
    records += handle.close()
    return records


def test_an_ordinary_run_raises_no_alarm_and_a_planted_spike_is_caught(capfd, kernel_backend):
    if kernel_backend == "triton":
        pytest.skip("end to end on the torch path: the kernel is checked against the rule above")
    model = _llama()
    handle = attach(model, [NonFiniteMonitor(every=8)], lagged=False, budget=None)
    records = _train(handle, model, 90, {70: 3.0})
    counts = [(r.step, r.value) for r in records if r.name == "monitors/step/loss_spike_count"]
    assert sum(v for _, v in counts) == 1
    first = [r.value for r in records if r.name == "monitors/step/loss_spike_first_step"]
    assert first == [70.0]
    grad = [r.value for r in records if r.name == "monitors/step/grad_norm_spike_count"]
    assert sum(grad) == 0
    lines = [x for x in capfd.readouterr().err.splitlines() if "spike" in x]
    assert len(lines) == 1 and "loss spike at step 70" in lines[0]


def test_on_spike_raise_and_callable(kernel_backend):
    if kernel_backend == "triton":
        pytest.skip("end to end on the torch path: the kernel is checked against the rule above")
    model = _llama()
    seen: list[SpikeEvent] = []
    handle = attach(model, [NonFiniteMonitor()], lagged=False, budget=None, on_spike=seen.append)
    _train(handle, model, 45, {40: 5.0})
    assert [(e.value, e.first_step) for e in seen] == [("loss", 40)]
    model = _llama()
    handle = attach(model, [NonFiniteMonitor()], lagged=False, budget=None, on_spike="raise")
    with pytest.raises(SpikeError, match="loss spike at step 40"):
        _train(handle, model, 45, {40: 5.0})
