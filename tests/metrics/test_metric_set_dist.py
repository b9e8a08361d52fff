"""Cross-rank aggregation for real: 2 gloo ranks on 127.0.0.1."""

import numpy as np
import pytest
import torch

from syncless.guard import no_sync
from syncless.metrics import MetricSet, SchemaMismatch
from syncless.testing import spawn_gloo

pytestmark = pytest.mark.dist


def _samples(rank):
    # Unequal token counts per rank: rank 1 has 7x more samples, so the mean of
    # per-rank means would be wrong.
    rng = np.random.default_rng(10 + rank)
    return rng.normal(loc=3.0 * rank, size=5 if rank == 0 else 35)


def _aggregate_worker(rank, world):
    ms = MetricSet()
    mean = ms.declare("t", "x_mean", "mean")
    mx = ms.declare("t", "x_max", "max")
    mn = ms.declare("t", "x_min", "min")
    # Pipeline-style: only rank 1 owns layer 5.
    own = ms.declare("t", "tokens_count", "sum", layer=5) if rank == 1 else None
    ms.declare("t", "tokens_count", "sum", layer=0)
    ms.allocate("cpu")
    x = torch.from_numpy(_samples(rank))
    with no_sync(cpu_as_device=True):
        mean.add(x.sum(), x.numel())
        mx.update(x.max())
        mn.update(x.min())
        if own is not None:
            own.add(torch.tensor(11.0))
        ms.slot("t/layer_00/tokens_count").add(torch.tensor(float(rank + 1)))
    (r,) = ms.flush(0, wait=True)
    return {k: r.get(k) for k in r.values}, ms.collectives, ms.d2h_copies


def test_two_ranks_aggregate_like_one_process():
    results = spawn_gloo(_aggregate_worker, 2)
    everything = np.concatenate([_samples(0), _samples(1)])
    for values, collectives, copies in results:  # every rank sees the cluster view
        np.testing.assert_allclose(values["t/step/x_mean"], [everything.mean()])
        np.testing.assert_allclose(values["t/step/x_max"], [everything.max()])
        np.testing.assert_allclose(values["t/step/x_min"], [everything.min()])
        np.testing.assert_allclose(values["t/layer_05/tokens_count"], [11.0])
        np.testing.assert_allclose(values["t/layer_00/tokens_count"], [3.0])
        np.testing.assert_allclose(values["t/global/tokens_count"], [14.0])
        assert (collectives, copies) == (2, 1)  # one SUM + one MAX, one D2H
    assert abs(everything.mean() - np.mean([_samples(0).mean(), _samples(1).mean()])) > 0.5


def _mismatch_worker(rank, world):
    ms = MetricSet()
    ms.declare("t", "x", "max" if rank == 0 else "mean")
    if rank == 0:
        ms.declare("t", "only_here", "sum")
    try:
        ms.allocate("cpu")
    except SchemaMismatch as e:
        return str(e)
    return None


def test_schema_mismatch_raises_on_every_rank_with_the_keys():
    for message in spawn_gloo(_mismatch_worker, 2):
        assert message is not None
        assert "declared differently: t/step/x" in message
        assert "missing: t/step/only_here (not declared on ranks [1])" in message


def _layer_specs_worker(rank, world):
    ms = MetricSet()
    for layer in (0, 100) if rank == 0 else (11, 2):  # each rank its own stage's layers
        ms.declare("t", "tokens_count", "sum", size=4, layer=layer, element="expert")
        ms.declare("t", "other", "max", layer=layer)
    ms.declare("u", "tokens_count", "sum", size=4, layer=7)  # another area, every rank
    ms.allocate("cpu")
    return {layer: spec.key for layer, spec in ms.layer_specs("t", "tokens_count").items()}


def test_layer_specs_cover_every_ranks_layers_in_layer_order():
    expected = {layer: f"t/layer_{layer:02d}/tokens_count" for layer in (0, 2, 11, 100)}
    for found in spawn_gloo(_layer_specs_worker, 2):
        assert list(found.items()) == list(expected.items())  # 100 after 11: by number
