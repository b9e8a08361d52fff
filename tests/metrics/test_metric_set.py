import math

import numpy as np
import pytest
import torch

from syncless.guard import no_sync
from syncless.metrics import MetricSet


def _declare(ms: MetricSet, layers=(0, 1)):
    for layer in layers:
        ms.declare("t", "act_mean", "mean", layer=layer)
        ms.declare("t", "absmax", "max", size=3, layer=layer, element="head")
        ms.declare("t", "low", "min", layer=layer)
        ms.declare("t", "tokens_count", "sum", size=4, layer=layer, element="expert")
    ms.declare("t", "loss", "mean")


def test_values_match_a_naive_recount():
    rng = np.random.default_rng(0)
    ms = MetricSet()
    _declare(ms)
    ms.allocate("cpu")
    truth = {layer: {"samples": [], "absmax": np.full(3, -np.inf), "low": np.inf,
                     "tokens": np.zeros(4)} for layer in (0, 1)}  # fmt: skip
    slots = {layer: {n: ms.slot(f"t/layer_{layer:02d}/{n}") for n in
                     ("act_mean", "absmax", "low", "tokens_count")} for layer in (0, 1)}  # fmt: skip
    with no_sync(cpu_as_device=True):
        for _ in range(5):
            for layer in (0, 1):
                xn = rng.normal(size=int(rng.integers(1, 50)))
                hn = rng.normal(size=3)
                tn = rng.integers(0, 9, size=4).astype(np.float64)
                x, heads, tokens = torch.from_numpy(xn), torch.from_numpy(hn), torch.from_numpy(tn)
                s = slots[layer]
                s["act_mean"].add(x.sum(), count=x.numel())
                s["absmax"].update(heads.abs())
                s["low"].update(x.min())
                s["tokens_count"].add(tokens)
                t = truth[layer]
                t["samples"] += list(xn)
                t["absmax"] = np.maximum(t["absmax"], np.abs(hn))
                t["low"] = min(t["low"], xn.min())
                t["tokens"] += tn
    (r,) = ms.flush(step=7, wait=True)
    assert r.step == 7
    for layer in (0, 1):
        t, p = truth[layer], f"t/layer_{layer:02d}"
        np.testing.assert_allclose(r.get(f"{p}/act_mean"), [np.mean(t["samples"])])
        np.testing.assert_allclose(r.get(f"{p}/absmax"), t["absmax"])
        np.testing.assert_allclose(r.get(f"{p}/low"), [t["low"]])
        np.testing.assert_allclose(r.get(f"{p}/tokens_count"), t["tokens"])
    # Globals over layers: the mean over all samples (not the mean of layer means).
    all_samples = truth[0]["samples"] + truth[1]["samples"]
    np.testing.assert_allclose(r.get("t/global/act_mean"), [np.mean(all_samples)])
    np.testing.assert_allclose(
        r.get("t/global/absmax"), np.maximum(truth[0]["absmax"], truth[1]["absmax"])
    )
    np.testing.assert_allclose(r.get("t/global/low"), [min(truth[0]["low"], truth[1]["low"])])
    np.testing.assert_allclose(
        r.get("t/global/tokens_count"), truth[0]["tokens"] + truth[1]["tokens"]
    )
    assert math.isnan(r.get("t/step/loss")[0])  # never recorded: absent, not zero
    names = {rec.name for rec in r.records("run", 0, 0.0)}
    assert "t/step/loss" not in names
    assert "t/layer_00/absmax/head_2" in names and "t/layer_01/tokens_count/expert_3" in names


def test_flush_is_lagged_by_default_and_resets():
    ms = MetricSet()
    slot = ms.declare("t", "x_sum", "sum")
    ms.allocate("cpu")
    slot.add(torch.tensor(2.0))
    assert ms.flush(0) == []
    slot.add(torch.tensor(5.0))
    (r0,) = ms.flush(1)
    assert (r0.step, r0.get("t/step/x_sum")[0]) == (0, 2.0)
    (r1,) = ms.drain()
    assert (r1.step, r1.get("t/step/x_sum")[0]) == (1, 5.0)
    assert ms.d2h_copies == 2 and ms.collectives == 0


class _Copy:
    """A stand-in for a flush's CUDA event: lands when the test says so, and records
    whether anyone waited on it."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.waited or not self.done  # a landed copy returns at once
        self.done = True


def test_a_copy_still_in_flight_is_read_at_a_later_flush_without_waiting():
    """A host ahead of the device: readouts come back late and in order, no flush waits
    until every host buffer holds a copy in flight, and then only for the oldest."""
    from syncless.metrics.metric_set import HOST_BUFFERS

    ms = MetricSet()
    slot = ms.declare("t", "x_sum", "sum")
    ms.allocate("cpu")
    copies = []

    def flush(step):
        slot.add(torch.tensor(float(step + 1)))
        out = ms.flush(step)
        copies.append(_Copy())
        ms._pending[-1].event = copies[-1]  # what a CUDA flush records
        return [(r.step, r.get("t/step/x_sum")[0]) for r in out]

    assert flush(0) == []
    assert flush(1) == []  # step 0's copy has not landed: nothing, and no wait
    copies[0].done = True
    assert flush(2) == [(0, 1.0)]
    copies[1].done = copies[2].done = True
    assert flush(3) == [(1, 2.0), (2, 3.0)]
    for step in range(4, 3 + HOST_BUFFERS):  # the host runs ahead of every copy
        assert flush(step) == []
    assert not any(c.waited for c in copies)
    # every buffer holds a copy in flight now: the next flush waits for the oldest only
    assert flush(3 + HOST_BUFFERS) == [(3, 4.0)]
    assert [c.waited for c in copies[3:5]] == [True, False]


def test_counts_stay_exact_beyond_2_pow_24():
    ms = MetricSet()
    slot = ms.declare("t", "v", "mean")
    ms.allocate("cpu")
    big = 2**24 + 1  # a float32 count would round this to 2^24
    for _ in range(3):
        slot.add(torch.tensor(float(big), dtype=torch.float64), count=big)
    slot.add(torch.tensor(0.0), count=1)
    (r,) = ms.flush(0, wait=True)
    expected = 3 * big / (3 * big + 1)
    assert r.get("t/step/v")[0] == pytest.approx(expected, rel=1e-15)


def test_clear_errors():
    ms = MetricSet()
    ms.declare("t", "a", "max")
    with pytest.raises(KeyError, match=r"'t/step/b' was not declared; declared metrics: t/step/a"):
        ms.slot("t/step/b")
    with pytest.raises(ValueError, match="unknown aggregation 'median'"):
        ms.declare("t", "c", "median")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already declared"):
        ms.declare("t", "a", "min")
    with pytest.raises(RuntimeError, match="not allocated"):
        ms.slot("t/step/a").update(torch.tensor(1.0))
    ms.allocate("cpu")
    with pytest.raises(RuntimeError, match="schema is locked"):
        ms.declare("t", "late", "sum")
    with pytest.raises(TypeError, match="use update"):
        ms.slot("t/step/a").add(torch.tensor(1.0))
    with pytest.raises(KeyError, match="was not declared"):
        ms.record("t/step/zzz", torch.tensor(1.0))


def test_device_gate_skips_records_nan_included():
    ms = MetricSet()
    mx = ms.declare("t", "m", "max")
    sm = ms.declare("t", "s", "mean")
    ms.allocate("cpu")
    mx.update(torch.tensor(1.0))
    sm.add(torch.tensor(4.0), 2)
    ms.set_enabled(False)
    with no_sync(cpu_as_device=True):
        mx.update(torch.tensor(float("nan")))
        mx.update(torch.tensor(9.0))
        sm.add(torch.tensor(100.0), 1)
    ms.set_enabled(True)
    (r,) = ms.flush(0, wait=True)
    assert r.get("t/step/m")[0] == 1.0 and r.get("t/step/s")[0] == 2.0
    mx.update(torch.tensor(float("nan")))  # recorded NaN is kept, not hidden
    (r,) = ms.flush(1, wait=True)
    assert math.isnan(r.get("t/step/m")[0]) and r.present["t/step/m"][0]


def test_recording_under_torch_compile():
    ms = MetricSet()
    mean = ms.declare("t", "x_mean", "mean")
    mx = ms.declare("t", "x_absmax", "max")
    ms.allocate("cpu")

    @torch.compile(backend="aot_eager", fullgraph=True)
    def hook(x):
        mean.add(x.sum(), x.numel())
        mx.update(x.abs().max())
        return x * 2

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(17, generator=g) for _ in range(3)]
    for x in xs:
        hook(x)
    ms.set_enabled(False)
    hook(torch.full((4,), 1e6))  # gated off: same compiled code, no effect
    ms.set_enabled(True)
    (r,) = ms.flush(0, wait=True)
    allx = torch.cat(xs).numpy()
    # float32 sums of mixed signs: the tolerance scales with the magnitudes summed
    scale = np.abs(allx).mean()
    np.testing.assert_allclose(r.get("t/step/x_mean"), [allx.mean()], rtol=0, atol=1e-6 * scale)
    np.testing.assert_allclose(r.get("t/step/x_absmax"), [np.abs(allx).max()], rtol=1e-6)


def test_records_match_a_naive_per_key_summary():
    """Every record (key summaries, element records, globals) against numpy over the
    recorded truth: absent keys and elements stay out, a recorded NaN stays in."""
    rng = np.random.default_rng(3)
    ms = MetricSet()
    specs = {
        "t/layer_00/m": ("mean", 1), "t/layer_01/m": ("mean", 1),
        "t/layer_00/v": ("mean", 4), "t/layer_01/v": ("mean", 4),
        "t/layer_00/c": ("sum", 3), "t/layer_01/c": ("sum", 3),
        "t/layer_00/x": ("max", 5), "t/layer_01/x": ("max", 5),
        "t/layer_00/lo": ("min", 2), "t/layer_01/lo": ("min", 2),
        "t/step/never": ("max", 1), "t/step/nan": ("max", 1),
    }  # fmt: skip
    for key, (agg, size) in specs.items():
        area, scope, name = key.split("/")
        layer = int(scope[-2:]) if scope.startswith("layer") else None
        ms.declare(area, name, agg, size=size, layer=layer)
    ms.allocate("cpu")
    truth: dict[str, np.ndarray] = {}
    with no_sync(cpu_as_device=True):
        for key, (agg, size) in specs.items():
            if key == "t/step/never":
                continue
            slot = ms.slot(key)
            if agg in ("mean", "sum"):
                totals, counts = rng.normal(size=size), rng.integers(1, 9, size=size)
                slot.add(torch.from_numpy(totals), count=torch.from_numpy(counts * 1.0))
                truth[key] = totals / counts if agg == "mean" else totals
                truth[key + "#count"] = counts * 1.0
            else:
                v = rng.normal(size=size)
                if key == "t/layer_01/x":
                    v[2] = -np.inf  # this element is never recorded: absent
                if key == "t/step/nan":
                    v[0] = np.nan
                slot.update(torch.from_numpy(v))
                truth[key] = v
    (r,) = ms.flush(step=3, wait=True)
    got = {rec.name: rec.value for rec in r.records("run", 0, 0.0)}
    expected: dict[str, float] = {}
    reduce = {"mean": np.mean, "sum": np.sum, "max": np.max, "min": np.min}
    for key, (agg, size) in specs.items():
        if key not in truth:
            continue
        v = truth[key]
        present = v != -np.inf if agg == "max" else np.ones(size, dtype=bool)
        expected[key] = float(reduce[agg](v[present]))
        if size > 1:
            for i in np.flatnonzero(present):
                expected[f"{key}/i_{i}"] = float(v[i])
    for name, agg in (("m", "mean"), ("v", "mean"), ("c", "sum"), ("x", "max"), ("lo", "min")):
        a, b = truth[f"t/layer_00/{name}"], truth[f"t/layer_01/{name}"]
        if agg == "mean":  # count-weighted over layers
            ca, cb = truth[f"t/layer_00/{name}#count"], truth[f"t/layer_01/{name}#count"]
            g = (a * ca + b * cb) / (ca + cb)
        elif agg == "sum":
            g = a + b
        else:
            g = np.maximum(a, b) if agg == "max" else np.minimum(a, b)
        key = f"t/global/{name}"
        expected[key] = float(reduce[agg](g))
        if g.size > 1:
            for i in range(g.size):
                expected[f"{key}/i_{i}"] = float(g[i])
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-12, err_msg=name)


def test_layer_specs_before_allocate_is_a_clear_error():
    ms = MetricSet()
    _declare(ms, layers=(3, 1))
    with pytest.raises(RuntimeError, match="before allocate"):
        ms.layer_specs("t", "absmax")
    ms.allocate("cpu")
    specs = ms.layer_specs("t", "absmax")
    assert list(specs) == [1, 3] and {s.size for s in specs.values()} == {3}
    assert ms.layer_specs("t", "loss") == {}  # a step metric has no layers
