import pytest
import torch

from syncless.dataplane.backends.memory import InMemoryStore
from syncless.dataplane.client import KVClient


def test_round_trip_copies_on_put_and_serves_any_order():
    store = InMemoryStore()
    assert isinstance(store, KVClient)
    obs = torch.randn(4, 3)
    seqs = torch.nested.nested_tensor([torch.arange(n) for n in (2, 5, 1, 3)], layout=torch.jagged)
    store.put(
        "p", ["a", "b", "c", "d"], {"obs": obs, "seq": seqs, "meta": [1, "x", {"k": 2}, None]}
    )
    obs_before = obs.clone()
    obs.add_(100)  # the writer's later in-place change must not reach the store

    got = store.get("p", ["d", "a"])
    torch.testing.assert_close(got["obs"], obs_before[[3, 0]], rtol=0, atol=0)
    assert [r.tolist() for r in got["seq"].unbind()] == [[0, 1, 2], [0, 1]]
    assert got["meta"] == [None, 1]
    assert store.get("p", ["b"], ["meta"]) == {"meta": ["x"]}


def test_jagged_on_get_like_transferqueue():
    store = InMemoryStore(jagged_on_get=True)
    x = torch.randn(3, 4)
    store.put("p", ["a", "b", "c"], {"x": x})
    got = store.get("p", ["a", "b", "c"])["x"]
    assert got.is_nested
    assert all(torch.equal(r, x[i]) for i, r in enumerate(got.unbind()))


def test_clear_list_and_errors():
    store = InMemoryStore()
    store.put("p", ["a", "b"], {"x": torch.zeros(2, 1)})
    store.clear("p", ["a"])
    assert store.list_keys("p") == ["b"]
    with pytest.raises(KeyError, match=r"keys not in partition 'p': \['a'\]"):
        store.get("p", ["a"])
    with pytest.raises(ValueError, match="has 3 rows for 2 keys"):
        store.put("p", ["x", "y"], {"x": torch.zeros(3)})
