"""--ep-splits for real: 2 gloo ranks, a fixed router, every mode against the drain path."""

import os
from collections import Counter

import pytest
import torch

from syncless.demo.config import preset
from syncless.demo.dispatch import AllToAllDispatcher
from syncless.demo.model import Experts, MoETransformer, fixed_routing, init_weights
from syncless.demo.sync_census import SyncCensusTool
from syncless.demo.train import run_demo
from syncless.guard import no_sync
from syncless.pacing import ENV_ENABLE, StaticPlanCache, StaticPlanError
from syncless.run import open as open_run
from syncless.testing import spawn_gloo

pytestmark = pytest.mark.dist

MODEL = dict(
    n_layers=2, d_model=32, n_heads=4, n_experts=4, top_k=2, expert_hidden=32, seq_len=16,
    expert_parallel=True, fix_router=True,
)  # fmt: skip
BATCHES = (2, 2, 3)  # the third batch changes the key (tokens per rank)
LAYER_CALLS = MODEL["n_layers"] * len(BATCHES)

MODES = {
    "drain": lambda: AllToAllDispatcher.for_mode("drain"),
    "static": lambda: AllToAllDispatcher.for_mode("static"),
    "static-paced": lambda: AllToAllDispatcher.for_mode("static-paced", run_ahead=1, device="cpu"),
    "lookahead": lambda: AllToAllDispatcher.for_mode("lookahead"),
    "probe-no-drains": lambda: AllToAllDispatcher(
        plan_cache=StaticPlanCache(enabled=True, probe="no-drains")
    ),
    "probe-no-collective": lambda: AllToAllDispatcher(
        plan_cache=StaticPlanCache(enabled=True, probe="no-collective")
    ),
    "validated": lambda: AllToAllDispatcher(
        plan_cache=StaticPlanCache(enabled=True, validate_every=1)
    ),
    # Not opted in: enabled is left to SYNCLESS_STATIC_PLAN, which is unset.
    "not-opted-in": lambda: AllToAllDispatcher(plan_cache=StaticPlanCache()),
}


class CountingComm:
    """The dispatcher's collective hook, counting calls by name."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def __call__(self, name, fn, *args, **kwargs):
        self.calls[name] += 1
        return fn(*args, **kwargs)


def _train_steps(rank, make_dispatcher):
    cfg = preset("tiny", **MODEL)
    dispatcher = make_dispatcher()
    dispatcher.comm = comm = CountingComm()
    model = MoETransformer(cfg, dispatcher)
    init_weights(model, cfg.seed)
    steps = []
    for i, batch in enumerate(BATCHES):
        g = torch.Generator().manual_seed(100 * rank + i)
        tokens = torch.randint(0, 256, (batch, cfg.seq_len), generator=g)
        model.zero_grad(set_to_none=True)
        with no_sync():  # every mode's hot path, forward and backward
            logits, balance = model(tokens)
            (logits.square().mean() + balance).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        steps.append((logits.detach(), grads))
        dispatcher.end_step()
    return steps, comm.calls["moe_counts"], dispatcher.report()


def _changing_router(rank, world):
    """A validating cache whose router moves after the plan was cached (on rank 1 only)."""
    tokens, d, n_experts, k = 12, 8, 4, 2
    dispatcher = AllToAllDispatcher(plan_cache=StaticPlanCache(enabled=True, validate_every=1))
    fn = Experts(n_experts // world, d, 16)
    (
        torch.nn.init.normal_(fn.w_gate),
        torch.nn.init.normal_(fn.w_up),
        torch.nn.init.normal_(fn.w_down),
    )
    x = torch.randn(tokens, d)
    weights = torch.full((tokens, k), 0.5)
    fixed = fixed_routing(tokens, k, n_experts, x.device)
    with no_sync():
        dispatcher(x, fixed, weights, fn)  # computes the plan
        dispatcher(x, fixed, weights, fn)  # reuses it, validated: it matches
    dispatcher.end_step()
    clean = dispatcher.report()["pacing/plan/mismatches_count"]
    moved = fixed.clone()
    if rank == 1:
        moved[:, 0] = 0  # this rank's router now sends most rows to expert 0
    with no_sync():
        dispatcher(x, moved, weights, fn)  # same key, stale plan: counted on the device
    local = dispatcher.plan_cache.mismatches()
    try:
        dispatcher.report()
        raised = None
    except StaticPlanError as e:
        raised = str(e)
    return clean, local, raised


def _worker(rank, world):
    os.environ.pop(ENV_ENABLE, None)
    modes = {name: _train_steps(rank, make) for name, make in MODES.items()}
    return modes, _changing_router(rank, world)


@pytest.fixture(scope="module")
def ranks():
    return spawn_gloo(_worker, 2)


def test_every_mode_routes_exactly_like_the_drain_path(ranks):
    for modes, _ in ranks:
        reference, _, _ = modes["drain"]
        for name, (steps, _, _) in modes.items():
            for (logits, grads), (want_logits, want_grads) in zip(steps, reference, strict=True):
                # Same split lists, same kernels: bitwise equal, not merely close.
                assert torch.equal(logits, want_logits), name
                assert grads.keys() == want_grads.keys(), name
                for param, grad in grads.items():
                    assert torch.equal(grad, want_grads[param]), (name, param)


def test_where_each_mode_takes_its_splits_from(ranks):
    # (counts exchanges, drains) over 3 steps x 2 layers; the cache misses twice (the
    # first call, and the first after the token count changed) and exchanges + drains then.
    expected = {
        "drain": (LAYER_CALLS, LAYER_CALLS),
        "static": (2, 2),
        "static-paced": (2, 2),
        "lookahead": (LAYER_CALLS, 0),
        "probe-no-drains": (LAYER_CALLS, 2),
        "probe-no-collective": (2, LAYER_CALLS),
        "validated": (2, 2),
        "not-opted-in": (LAYER_CALLS, LAYER_CALLS),
    }
    for modes, _ in ranks:
        for name, (_, exchanges, report) in modes.items():
            assert (exchanges, report["pacing/step/drains_count"]) == expected[name], name
        static = modes["static"][2]
        assert (static["pacing/plan/hits_count"], static["pacing/plan/misses_count"]) == (4, 2)
        assert static["pacing/plan/unchecked_reuses_count"] == 4
        not_opted_in = modes["not-opted-in"][2]
        assert not_opted_in["pacing/plan/hits_count"] == 0
        assert not_opted_in["pacing/plan/disabled_lookups_count"] == LAYER_CALLS
        paced = modes["static-paced"][2]
        assert paced["pacing/step/run_ahead_points_count"] == LAYER_CALLS
        assert paced["pacing/step/run_ahead_unpaced_count"] == LAYER_CALLS  # CPU: no events
        assert modes["lookahead"][2]["pacing/step/lookahead_reads_count"] == LAYER_CALLS
        validated = modes["validated"][2]
        assert validated["pacing/plan/validations_count"] == 4
        assert validated["pacing/plan/mismatches_count"] == 0


def test_validation_catches_a_router_that_changes_its_plan(ranks):
    (_, rank0), (_, rank1) = ranks
    assert rank0[0] == rank1[0] == 0  # while the router was static
    assert (rank0[1], rank1[1]) == (0, 1)  # only rank 1's counts moved...
    for _, (_, _, raised) in ranks:  # ...and every rank stops, not just rank 1
        assert raised is not None and "1 validated reuse(s) did not match" in raised


def _census_worker(rank, world, root):
    for mode in ("drain", "static", "static-paced", "lookahead"):
        cfg = preset(
            "tiny", steps=3, n_layers=3, batch_size=2, seq_len=32, log_every=1,
            expert_parallel=True, fix_router=True, ep_splits=mode,
        )  # fmt: skip
        run_demo(cfg, run_dir=f"{root}/{mode}", name=mode, quiet=True,
                 tools=[SyncCensusTool(steps=2)])  # fmt: skip


def test_census_on_the_demo_shows_the_drains_gone(tmp_path):
    spawn_gloo(_census_worker, 2, str(tmp_path))
    for mode, per_layer in (("drain", 3), ("static", 0), ("static-paced", 0), ("lookahead", 0)):
        with open_run(tmp_path / mode) as store:
            _, rows = store.query(
                "SELECT rank, name, sum(value) FROM metrics WHERE name LIKE 'guard/site/%' "
                "GROUP BY 1, 2 ORDER BY 1, 2"
            )
            _, reads = store.query(
                "SELECT sum(value) FROM metrics WHERE name = 'pacing/step/lookahead_reads_count'"
            )
        for rank in (0, 1):
            sites = {name: n for r, name, n in rows if r == rank}
            dispatch = sum(n for s, n in sites.items() if ".demo.dispatch." in s)
            train = sum(n for s, n in sites.items() if ".demo.train." in s)
            # Census steps 1 and 2 (step 0, where the static plan is computed, is
            # skipped): one drain per MoE layer in drain mode, none in the others; the
            # loss of each logged step is read a step late from pinned memory, no sync.
            assert dispatch == 2 * per_layer, (mode, sites)
            assert train == 0, (mode, sites)
            assert sum(sites.values()) == dispatch + train, (mode, sites)
        if mode == "lookahead":  # not drained, but read: 3 layers x 3 steps x 2 ranks
            assert reads[0][0] == 18
