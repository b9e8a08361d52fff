"""StaticPlanCache: opt-in, keys, one log line per plan, probes, device-side validation."""

import pytest
import torch

from syncless.pacing import (
    ENV_ENABLE,
    ENV_PROBE,
    ENV_VALIDATE_EVERY,
    DispatchPlan,
    PlanKey,
    StaticPlanCache,
    StaticPlanError,
)

WORLD = 2


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    for name in (ENV_ENABLE, ENV_PROBE, ENV_VALIDATE_EVERY):
        monkeypatch.delenv(name, raising=False)


def _plan(send: list[int], recv: list[int] | None = None) -> DispatchPlan:
    recv = send if recv is None else recv
    return DispatchPlan.build(send, recv, torch.tensor(send), torch.tensor(recv), WORLD)


def _key(tokens: int = 6, **kw) -> PlanKey:
    args = dict(tokens=tokens, top_k=2, world_size=WORLD, n_experts=4, device="cpu") | kw
    return PlanKey.contiguous(**args)


def test_plan_lists_and_regroup_from_counts():
    # 4 experts, 2 per rank. This rank receives, rank-major: from rank 0, 1 row for
    # its local expert 0 and 2 for expert 1; from rank 1, 3 rows for expert 0.
    plan = _plan([3, 1, 2, 0], [1, 2, 3, 0])
    assert plan.in_splits == [4, 2] and plan.out_splits == [3, 3]
    assert plan.local_counts == [4, 2]
    # received rows [e0 | e1 e1 | e0 e0 e0]; by expert: rows 0, 3, 4, 5, then 1, 2
    assert plan.regroup.tolist() == [0, 3, 4, 5, 1, 2]


def test_the_key_is_what_pins_a_plan():
    assert _key() == _key()
    assert _key().expert_owners == (0, 0, 1, 1)
    for other in (
        _key(tokens=7),
        _key(top_k=1),
        _key(world_size=4),
        _key(n_experts=8),
        _key(device="cuda:0"),
    ):
        assert other != _key()


def test_disabled_by_default_never_hits():
    cache = StaticPlanCache()
    assert not cache.enabled
    assert cache.get(_key()) is None
    with pytest.raises(RuntimeError, match="disabled cache"):
        cache.put(_key(), _plan([3, 3, 3, 3]))
    assert cache.stats()["disabled_lookups"] == 1
    assert cache.hits == 0 and len(cache) == 0


@pytest.mark.parametrize(
    ("value", "enabled"), [("1", True), ("true", True), ("0", False), ("", False)]
)
def test_the_environment_variable_opts_in(monkeypatch, value, enabled):
    monkeypatch.setenv(ENV_ENABLE, value)
    assert StaticPlanCache().enabled is enabled


def test_the_api_flag_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_ENABLE, "1")
    assert StaticPlanCache(enabled=False).enabled is False
    monkeypatch.setenv(ENV_ENABLE, "0")
    assert StaticPlanCache(enabled=True).enabled is True


def test_bad_environment_values_are_clear(monkeypatch):
    monkeypatch.setenv(ENV_ENABLE, "maybe")
    with pytest.raises(ValueError, match="SYNCLESS_STATIC_PLAN='maybe'"):
        StaticPlanCache()
    monkeypatch.setenv(ENV_ENABLE, "1")
    monkeypatch.setenv(ENV_VALIDATE_EVERY, "often")
    with pytest.raises(ValueError, match="number of steps"):
        StaticPlanCache()
    monkeypatch.setenv(ENV_VALIDATE_EVERY, "5")
    monkeypatch.setenv(ENV_PROBE, "drains")
    with pytest.raises(ValueError, match="no-drains, no-collective"):
        StaticPlanCache()


def test_a_changed_key_misses(capsys):
    cache = StaticPlanCache(enabled=True)
    plan = _plan([3, 3, 3, 3])
    assert cache.get(_key()) is None
    cache.put(_key(), plan)
    assert cache.get(_key()) is plan
    assert cache.get(_key(tokens=7)) is None
    assert cache.get(_key(device="cuda:0")) is None
    assert (cache.hits, cache.misses) == (1, 3)


def test_a_plan_is_logged_once_on_its_first_reuse(capsys):
    cache = StaticPlanCache(enabled=True)
    cache.put(_key(), _plan([3, 3, 3, 3]))
    assert capsys.readouterr().err == ""  # computing it is not reusing it
    for _ in range(3):
        cache.get(_key())
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert "reusing a static dispatch plan (not validated)" in err[0]
    assert "tokens=6 top_k=2 world_size=2 experts=4" in err[0]
    assert "sends [6, 6] rows to ranks" in err[0]
    cache.put(_key(tokens=8), _plan([4, 4, 4, 4]))
    cache.get(_key(tokens=8))
    assert len(capsys.readouterr().err.splitlines()) == 1  # a new plan, a new line


def test_clear_forgets_plans_and_their_log(capsys):
    cache = StaticPlanCache(enabled=True)
    cache.put(_key(), _plan([3, 3, 3, 3]))
    cache.get(_key())
    cache.clear()
    assert len(cache) == 0 and cache.get(_key()) is None
    cache.put(_key(), _plan([3, 3, 3, 3]))
    cache.get(_key())
    assert len(capsys.readouterr().err.splitlines()) == 2


def test_probes():
    assert StaticPlanCache(enabled=True, probe="no-drains").exchanges_counts
    assert not StaticPlanCache(enabled=True, probe="no-drains").drains
    assert StaticPlanCache(enabled=True, probe="no-collective").drains
    assert not StaticPlanCache(enabled=True).drains
    with pytest.raises(ValueError, match="probe 'both'"):
        StaticPlanCache(enabled=True, probe="both")  # type: ignore[arg-type]


def _validate_under_no_sync(cache: StaticPlanCache, plan: DispatchPlan, counts: list[int]) -> None:
    from syncless.guard import no_sync

    with no_sync():  # the hot-path half: compare on the device, read nothing back
        cache.validate(plan, torch.tensor(counts))


def test_validation_counts_mismatches_on_the_device_and_reads_them_at_check():
    cache = StaticPlanCache(enabled=True, validate_every=2)
    plan = _plan([3, 3, 3, 3])
    schedule = []
    for _ in range(5):
        schedule.append(cache.validating)
        _validate_under_no_sync(cache, plan, [3, 3, 3, 3])
        _validate_under_no_sync(cache, plan, [4, 2, 3, 3])  # a router that moved
        cache.step()
    assert schedule == [True, False, True, False, True]  # steps 0, 2, 4
    assert cache.validations == 6
    assert cache.mismatches() == 3  # one mismatching call in each validated step
    with pytest.raises(StaticPlanError, match="3 validated reuse"):
        cache.check()


def test_no_validation_means_unchecked_reuses_are_counted():
    cache = StaticPlanCache(enabled=True)  # validate_every defaults to 0: off
    cache.put(_key(), _plan([3, 3, 3, 3]))
    for _ in range(4):
        plan = cache.get(_key())
        cache.validate(plan, torch.tensor([9, 9, 9, 9]))
    assert cache.validations == 0 and cache.mismatches() == 0
    assert cache.unchecked_reuses == 4  # said, not hidden: nobody looked
    cache.check()


def test_validate_every_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_VALIDATE_EVERY, "3")
    assert StaticPlanCache(enabled=True).validate_every == 3
    assert StaticPlanCache(enabled=True, validate_every=0).validate_every == 0
