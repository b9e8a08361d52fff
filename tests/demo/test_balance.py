"""The demo router's bias balancing (``--balance bias``, DeepSeek-V3's auxiliary-loss-free
method): it moves the load toward balance, leaves the gate's gradient alone, runs on
the device only, sums the load over ranks inside the gradient all_reduce, and is state
that round-trips through the model's state dict."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from syncless.demo.config import preset
from syncless.demo.model import ExpertBalancer, MoETransformer, Router, init_weights
from syncless.demo.parallel import sync_gradients
from syncless.errors import UsageError
from syncless.guard import no_sync
from syncless.testing import spawn_gloo

D, E, K, T = 32, 8, 2, 512
SPEED = 1e-3


def _skewed_router(bias: bool) -> Router:
    """Expert 0, then 1, favoured for inputs with a positive mean: ~49% of the picks go
    to expert 0 at the start (top-2 caps a share at 50%; balanced is 1/E = 12.5%)."""
    torch.manual_seed(0)
    router = Router(D, E, K, bias=bias)
    with torch.no_grad():
        router.gate.weight.normal_(0.0, 0.02)
        router.gate.weight[0] += 0.05
        router.gate.weight[1] += 0.02
    return router


def _inputs(step: int, tokens: int = T) -> torch.Tensor:
    return torch.randn(tokens, D, generator=torch.Generator().manual_seed(step)) + 0.5


def _max_shares(router: Router, steps: int) -> list[float]:
    """Each step's largest share of the (token, expert) picks, counted here from the
    experts the router returned; the gate is not trained, only the bias moves."""
    balancer = ExpertBalancer(router, SPEED)
    shares = []
    for step in range(steps):
        _, experts, _ = router(_inputs(step))
        picks = [0] * E
        for expert in experts.flatten().tolist():
            picks[expert] += 1
        if router.expert_bias is not None:  # the router's own count is the same
            assert router.expert_load.tolist() == picks
        shares.append(max(picks) / (T * K))
        balancer.step()
    return shares


def test_the_bias_brings_a_skewed_router_to_within_a_band_of_balance():
    biased, plain = _max_shares(_skewed_router(True), 150), _max_shares(_skewed_router(False), 150)
    assert min(biased[:3]) > 0.45 and min(plain) > 0.45  # the skew, and it stays without
    # From step 100 on (measured: 0.137-0.156 from step 80), the largest share stays
    # within 1.5/E of every step and 1.25/E on average: balanced is 1/E.
    late = biased[100:]
    assert max(late) < 1.5 / E
    assert sum(late) / len(late) < 1.25 / E


def test_the_bias_chooses_experts_but_leaves_the_gates_gradient_alone():
    router = _skewed_router(True)
    with torch.no_grad():
        router.expert_bias.copy_(torch.linspace(-0.05, 0.05, E))  # changes the choice
    x = _inputs(0, 64)
    cost = torch.randn(64, K, generator=torch.Generator().manual_seed(1))
    weights, experts, probs = router(x)
    (weights * cost).sum().backward()
    assert not router.expert_bias.requires_grad
    assert "expert_bias" not in dict(router.named_parameters())

    # Reference in float64 from the gate's weights: the unbiased probabilities of the
    # same choice, renormalised over the k chosen.
    w = router.gate.weight.detach().double().requires_grad_(True)
    ref_probs = (x.double() @ w.t()).softmax(-1)
    chosen = ref_probs.gather(-1, experts)
    ((chosen / chosen.sum(-1, keepdim=True)) * cost.double()).sum().backward()
    torch.testing.assert_close(router.gate.weight.grad.double(), w.grad, rtol=1e-5, atol=1e-7)
    # and the choice is not the unbiased top-k
    assert not torch.equal(experts.sort(-1).values, probs.topk(K).indices.sort(-1).values)


def test_a_demo_training_step_with_the_bias_runs_without_a_sync():
    cfg = preset("tiny")  # --balance bias is the default
    model = MoETransformer(cfg)
    init_weights(model, seed=0)
    balancer = ExpertBalancer(model, cfg.bias_update_speed)
    assert len(balancer.routers) == cfg.n_layers
    tokens = torch.randint(0, 256, (2, cfg.seq_len), generator=torch.Generator().manual_seed(0))
    with no_sync():  # forward, backward, the loads' all_reduce (world 1: none), the update
        logits, balance = model(tokens)
        (F.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + 0.01 * balance).backward()
        sync_gradients(model, False, also=balancer.loads)
        balancer.step()
    for router in balancer.routers:
        assert router.expert_load.sum() == 0  # restarted
        assert router.expert_bias.abs().max() == pytest.approx(cfg.bias_update_speed)


def test_the_bias_is_model_state_and_round_trips_through_the_state_dict():
    """The demo keeps no checkpoint (``--resume`` starts a fresh model, docs/demo.md);
    a trainer that saves the model's state dict keeps the bias with it."""
    cfg = preset("tiny")
    model = MoETransformer(cfg)
    init_weights(model, seed=0)
    for i, block in enumerate(model.layers):
        block.moe.router.expert_bias.copy_(torch.arange(cfg.n_experts) * 0.01 * (i + 1))
    state = model.state_dict()
    assert "layers.1.moe.router.expert_bias" in state
    assert not any(key.endswith("expert_load") for key in state)  # per update, not state
    fresh = MoETransformer(cfg)
    fresh.load_state_dict(state)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(fresh(tokens)[0], model(tokens)[0], rtol=0, atol=0)


def test_a_fixed_router_and_the_other_balance_modes_have_no_bias():
    for overrides in ({"fix_router": True}, {"balance": "aux"}, {"balance": "none"}):
        model = MoETransformer(preset("tiny", **overrides))
        assert ExpertBalancer(model, 1e-3).routers == []
        assert model.layers[0].moe.router.expert_bias is None
    with pytest.raises(UsageError, match="--balance must be one of bias, aux, none"):
        preset("tiny", balance="loss").validate()
    with pytest.raises(UsageError, match="--bias-update-speed must be > 0"):
        preset("tiny", bias_update_speed=0.0).validate()


def _two_ranks(rank: int, world: int) -> tuple[list[float], list[float]]:
    """Each rank routes its half of the tokens; the loads ride in the gradient
    all_reduce; both ranks move their bias the same way."""
    router = _skewed_router(True)
    balancer = ExpertBalancer(router, SPEED)
    for step in range(5):
        weights, _, _ = router(_inputs(step).chunk(world)[rank])
        weights.sum().backward()  # a gradient to all_reduce with the loads
        sync_gradients(router, False, also=balancer.loads)
        if step == 4:
            load = router.expert_load.tolist()
        balancer.step()
    return load, router.expert_bias.tolist()


@pytest.mark.dist
def test_under_data_or_expert_parallelism_the_update_uses_the_global_load():
    results = spawn_gloo(_two_ranks, 2, timeout_s=120)
    # Ground truth: one process routes both halves (the ranks' shapes: the same bits)
    # with the same bias updates.
    router = _skewed_router(True)
    balancer = ExpertBalancer(router, SPEED)
    for step in range(5):
        for half in _inputs(step).chunk(2):
            router(half)
        if step == 4:
            whole = router.expert_load.tolist()
        balancer.step()
    for load, bias in results:
        assert load == [count / 2 for count in whole]  # averaged over the 2 ranks
        assert bias == router.expert_bias.tolist()


@pytest.mark.slow
def test_under_torch_compile_the_loads_and_the_bias_follow_eager():
    cfg = preset("tiny")
    compiled, eager = MoETransformer(cfg), MoETransformer(cfg)
    for model in (compiled, eager):
        init_weights(model, seed=0)
    balancers = [ExpertBalancer(compiled, SPEED), ExpertBalancer(eager, SPEED)]
    call = torch.compile(compiled, backend="aot_eager")  # no compiler needed
    for step in range(2):
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(step))
        loads = []
        for forward, balancer in zip((call, eager), balancers, strict=True):
            logits, balance = forward(tokens)
            (F.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + 0.01 * balance).backward()
            loads.append([load.clone() for load in balancer.loads])
            balancer.step()
        for got, want in zip(*loads, strict=True):
            assert torch.equal(got, want) and got.sum() == 2 * 32 * cfg.top_k
    for got, want in zip(*(b.routers for b in balancers), strict=True):
        assert torch.equal(got.expert_bias, want.expert_bias)
