import logging

import pytest
import torch

from syncless.dataplane import metrics_client as mc
from syncless.dataplane.backends.memory import InMemoryStore
from syncless.dataplane.backends.null import NullStore
from syncless.dataplane.metrics_client import MetricsClient
from syncless.guard import no_sync


def _nbytes(*tensors):
    return sum(t.contiguous().nbytes for t in tensors)  # ground truth: a real copy


def test_counters_bytes_and_step_differencing():
    client = MetricsClient(InMemoryStore())
    obs = torch.randn(8, 16)
    act = torch.randint(0, 5, (8, 3))[:, ::2]  # a strided view
    keys = [f"k{i}" for i in range(8)]
    client.put("p", keys, {"obs": obs, "act": act})
    got = client.get("p", keys[:4], ["obs"])
    torch.testing.assert_close(got["obs"], obs[:4], rtol=0, atol=0)
    m = client.step(step_wall_ms=100.0)
    assert m["dataplane/step/put/calls_count"] == 1
    assert m["dataplane/step/put/keys_count"] == 8
    assert m["dataplane/step/put/mb"] * 2**20 == _nbytes(obs, act)
    assert m["dataplane/step/get/mb"] * 2**20 == _nbytes(obs[:4])
    assert m["dataplane/step/get/calls_count"] == 1
    assert m["dataplane/step/outstanding_mb"] * 2**20 == _nbytes(obs, act)
    wall = m["dataplane/step/put/wall_ms"] + m["dataplane/step/get/wall_ms"]
    assert m["dataplane/step/frac_of_step"] == pytest.approx(wall / 100.0)
    assert m["dataplane/step/put/max_ms"] <= m["dataplane/step/put/wall_ms"] + 1e-9
    assert "dataplane/step/put/p99_ms" not in m  # one call: no percentile, only the max
    assert 0 <= m["dataplane/step/self/overhead_ms"] <= wall

    client.clear("p", keys[:2])  # released pro rata: 2 of 8 keys
    m = client.step()
    assert m["dataplane/step/put/calls_count"] == 0  # differenced
    assert m["dataplane/step/clear/calls_count"] == 1
    per_key = _nbytes(obs, act) // 8
    assert m["dataplane/step/outstanding_mb"] * 2**20 == _nbytes(obs, act) - 2 * per_key
    assert m["dataplane/step/peak_mb"] * 2**20 == _nbytes(obs, act)


def test_reconcile_drops_keys_another_process_cleared():
    store = InMemoryStore()
    writer = MetricsClient(store, reconcile_every=2)
    writer.put("p", ["a", "b"], {"x": torch.zeros(2, 1000)})
    store.clear("p", ["a", "b"])  # a reader elsewhere consumed them
    assert writer.step()["dataplane/step/outstanding_mb"] > 0
    assert writer.step()["dataplane/step/outstanding_mb"] == 0  # reconciled at step 2


class _Failing(InMemoryStore):
    def get(self, *a, **k):
        raise ConnectionError("store down")


def test_inner_errors_are_counted_and_reraised():
    client = MetricsClient(_Failing())
    with pytest.raises(ConnectionError):
        client.get("p", ["a"])
    assert client.step()["dataplane/step/get/errors_count"] == 1


def test_accounting_failure_never_fails_the_step(monkeypatch, caplog):
    def broken(value, **kw):
        raise RuntimeError("bug in accounting")

    monkeypatch.setattr(mc, "payload_nbytes", broken)
    client = MetricsClient(InMemoryStore())
    with caplog.at_level(logging.WARNING):
        client.put("p", ["a"], {"x": torch.ones(1, 2)})
        out = client.get("p", ["a"])
    torch.testing.assert_close(out["x"], torch.ones(1, 2))
    assert client.step()["dataplane/step/self/accounting_errors_count"] == 2
    assert "accounting of put failed" in caplog.text


def test_wire_guard_across_writer_and_reader_catches_a_corrupted_row():
    store = InMemoryStore(jagged_on_get=True)  # put dense, get jagged
    writer = MetricsClient(store, verify_hash=True)
    reader = MetricsClient(store, verify_hash=True)
    x = torch.randn(6, 5)
    keys = [f"k{i}" for i in range(6)]
    writer.put("p", keys, {"x": x, "meta": list(range(6))})
    out = reader.get("p", keys[::-1], ["x", "meta"])
    assert "x.__digest" not in out
    m = reader.step()
    assert m["dataplane/step/guard/rows_checked_count"] == 6
    assert m["dataplane/step/guard/mismatches_count"] == 0
    assert m["dataplane/step/guard/fields_skipped_count"] == 1  # meta: not a tensor

    store._rows["p"]["k3"]["x"][2] += 1.0  # the wire flips one value
    reader.get("p", keys, ["x"])
    m = reader.step()
    assert (m["dataplane/step/guard/rows_checked_count"],
            m["dataplane/step/guard/mismatches_count"]) == (6, 1)  # fmt: skip


def test_wrapper_hot_path_is_sync_free():
    dense = torch.randn(4, 8)
    jagged = torch.nested.nested_tensor([torch.randn(n) for n in (3, 1, 4, 2)],
                                        layout=torch.jagged)  # fmt: skip
    client = MetricsClient(NullStore({"d": dense, "j": jagged}), verify_hash=True)
    with no_sync(cpu_as_device=True):
        client.put("p", list("abcd"), {"d": dense, "j": jagged})
        client.get("p", list("abcd"))
        client.clear("p", list("abcd"))


def test_a_reader_without_the_guard_never_sees_the_digest_mirrors():
    store = InMemoryStore()
    MetricsClient(store, verify_hash=True).put("p", ["a", "b"], {"x": torch.ones(2, 3)})
    reader = MetricsClient(store)
    out = reader.get("p", ["a", "b"])
    assert list(out) == ["x"]
    assert reader.step()["dataplane/step/get/mb"] * 2**20 == torch.ones(2, 3).nbytes
