"""A real TransferQueue round trip (Ray started with 4 logical CPUs on 127.0.0.1)."""

import msgpack
import pytest
import torch

pytest.importorskip("transfer_queue")

from syncless.dataplane.backends.transferqueue import TransferQueueStore


@pytest.fixture(scope="module")
def store():
    s = TransferQueueStore()
    yield s
    s.close()


def _rows(value):
    return list(value.unbind(0))


def test_put_dense_get_jagged_round_trip(store):
    keys = [f"k{i}" for i in range(6)]
    obs = torch.randn(6, 5)
    ids = torch.arange(18).view(6, 3)
    meta = [{"i": i, "tag": f"row{i}"} for i in range(6)]
    store.put("train", keys, {"obs": obs, "ids": ids, "meta": meta})

    wanted = ["k4", "k0", "k2"]  # a subset, out of order
    got = store.get("train", wanted, ["obs", "ids", "meta"])
    assert got["obs"].is_nested  # TransferQueue >= 0.1.8: dense in, jagged out
    for row, key in zip(_rows(got["obs"]), wanted, strict=True):
        torch.testing.assert_close(row, obs[int(key[1:])], rtol=0, atol=0)
    for row, key in zip(_rows(got["ids"]), wanted, strict=True):
        assert torch.equal(row, ids[int(key[1:])])
    assert got["meta"] == [meta[4], meta[0], meta[2]]

    assert sorted(store.list_keys("train")) == sorted(keys)
    store.clear("train", ["k0", "k1"])
    assert sorted(store.list_keys("train")) == keys[2:]


def test_round_trip_through_the_metrics_wrapper_with_the_guard(store):
    from syncless.dataplane.metrics_client import MetricsClient

    writer = MetricsClient(store, verify_hash=True)
    reader = MetricsClient(store, verify_hash=True)
    keys = [f"w{i}" for i in range(5)]
    x = torch.randn(5, 7)
    writer.put("wrapped", keys, {"x": x, "tag": [f"t{i}" for i in range(5)]})
    got = reader.get("wrapped", keys[::-1], ["x", "tag"])
    for row, i in zip(got["x"].unbind(0), range(4, -1, -1), strict=True):
        torch.testing.assert_close(row, x[i], rtol=0, atol=0)
    assert got["tag"] == [f"t{i}" for i in range(4, -1, -1)]
    m = reader.step()
    assert m["dataplane/step/guard/rows_checked_count"] == 5
    assert m["dataplane/step/guard/mismatches_count"] == 0
    # Ground truth: the tensor's bytes plus the tags' msgpack encoding (the digest
    # mirrors are the guard's, not the payload's).
    tags_bytes = len(msgpack.packb([f"t{i}" for i in range(5)]))
    assert m["dataplane/step/get/mb"] * 2**20 == x.nbytes + tags_bytes
    assert writer.step()["dataplane/step/put/mb"] * 2**20 == x.nbytes + tags_bytes
    reader.clear("wrapped", keys)
    assert store.list_keys("wrapped") == []
