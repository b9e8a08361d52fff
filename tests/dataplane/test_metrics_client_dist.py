"""Cluster view across 2 real gloo ranks: counters sum, maxima max, histograms merge."""

import pytest
import torch

from syncless.dataplane.histogram import LogHistogram
from syncless.dataplane.metrics_client import MetricsClient, cluster_step
from syncless.testing import spawn_gloo

pytestmark = pytest.mark.dist


class _Sleepy:
    """A store whose gets take a known, rank-dependent time (recorded, not slept)."""

    def put(self, partition, keys, fields):
        pass

    def get(self, partition, keys, fields=None):
        return {"x": torch.zeros(len(keys), 4)}

    def clear(self, partition, keys):
        pass

    def list_keys(self, partition):
        return []


def _worker(rank, world):
    client = MetricsClient(_Sleepy())
    n_gets = 30 if rank == 0 else 600  # unequal call counts per rank
    for _ in range(n_gets):
        client.get("p", ["a", "b"])
    client.put("p", ["a"] * (rank + 1), {"x": torch.zeros(rank + 1, 8)})
    local = client.step(step_wall_ms=10.0 * (rank + 1))
    merged = cluster_step(local, client.step_histograms)
    return local, merged, client.step_histograms["get"]


def test_cluster_step_sums_counters_and_merges_histograms():
    (l0, m0, h0), (l1, m1, h1) = spawn_gloo(_worker, 2)
    assert m0 == m1  # every rank gets the same cluster view
    assert m0["dataplane/step/get/calls_count"] == 630
    assert m0["dataplane/step/put/keys_count"] == 3
    assert m0["dataplane/step/put/mb"] == pytest.approx((1 * 8 + 2 * 8) * 4 / 2**20)
    assert m0["dataplane/step/frac_of_step"] == max(
        l0["dataplane/step/frac_of_step"], l1["dataplane/step/frac_of_step"]
    )
    assert m0["dataplane/step/get/max_ms"] == max(
        l0["dataplane/step/get/max_ms"], l1["dataplane/step/get/max_ms"]
    )
    # p99 needs 500 samples: no single rank with 30 has one, rank 1 alone and the
    # cluster (630) do; the cluster value comes from the summed histogram.
    assert "dataplane/step/get/p99_ms" not in l0
    union = LogHistogram().merge(h0).merge(h1)  # independent merge of the two ranks
    assert union.count == 630
    expected = min(union.quantile(0.99), m0["dataplane/step/get/max_ms"])
    assert m0["dataplane/step/get/p99_ms"] == expected
