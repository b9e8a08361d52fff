import torch
import torch.nn.functional as F

from syncless.demo.config import preset
from syncless.demo.data import BatchSampler
from syncless.demo.dispatch import LocalDispatcher
from syncless.demo.model import Experts, MoETransformer, init_weights


def naive_moe(x, experts, weights, w_gate, w_up, w_down):
    """Token by token, choice by choice: sum_k w_k * SwiGLU_{e_k}(x)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[t, j])
            h = F.silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e])
            out[t] += weights[t, j] * (h @ w_down[e])
    return out


def _random_experts(n, d, h, seed=0):
    g = torch.Generator().manual_seed(seed)
    fn = Experts(n, d, h)
    with torch.no_grad():
        for p in fn.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return fn


def test_local_dispatch_matches_naive_reference_forward_and_backward():
    torch.manual_seed(0)
    t, d, h, n, k = 37, 8, 12, 5, 2
    fn = _random_experts(n, d, h)
    x = torch.randn(t, d, requires_grad=True)
    experts = torch.stack([torch.randperm(n)[:k] for _ in range(t)])
    experts[:10] = 0  # an expert with many tokens; expert 4 may get none
    experts[:10, 1] = 1
    weights = torch.rand(t, k)

    out = LocalDispatcher()(x, experts, weights, fn)
    out.square().sum().backward()
    grads = [x.grad.clone()] + [p.grad.clone() for p in fn.parameters()]

    x_ref = x.detach().clone().requires_grad_(True)
    params = [p.detach().clone().requires_grad_(True) for p in fn.parameters()]
    ref = naive_moe(x_ref, experts, weights, *params)
    ref.square().sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, [x_ref.grad] + [p.grad for p in params], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_expert_init_is_independent_of_sharding():
    """Rank r's expert slices equal the unsharded model's slices for the same experts."""
    cfg = preset("tiny", n_experts=4)
    full = MoETransformer(cfg)
    init_weights(full, seed=7)

    class HalfDispatcher(LocalDispatcher):
        def local_experts(self, n):
            return n // 2

        def first_local_expert(self, n):
            return n // 2

    shard = MoETransformer(cfg, HalfDispatcher())
    init_weights(shard, seed=7)
    full_params = dict(full.named_parameters())
    for name, p in shard.named_parameters():
        if ".experts." in name:
            torch.testing.assert_close(p, full_params[name][2:], rtol=0, atol=0)
        else:
            torch.testing.assert_close(p, full_params[name], rtol=0, atol=0)


def test_sampler_rank_slices_concatenate_to_the_single_process_batch():
    corpus = torch.arange(10_000, dtype=torch.int64) % 251
    whole = BatchSampler(corpus, seq_len=16, batch=6, rank=0, world_size=1, seed=3)
    parts = [BatchSampler(corpus, 16, 2, rank=r, world_size=3, seed=3) for r in range(3)]
    for step in (0, 1, 17):
        x, y = whole.batch_at(step)
        xs, ys = zip(*(p.batch_at(step) for p in parts), strict=True)
        assert torch.equal(torch.cat(xs), x) and torch.equal(torch.cat(ys), y)
        assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one byte
