"""The experts' three impls against a token-by-token reference, forward and backward,
and the demo's training step under the sync guard."""

import pytest
import torch
import torch.nn.functional as F

from syncless.demo.config import preset
from syncless.demo.dispatch import LocalDispatcher
from syncless.demo.experts import GROUP_ALIGN, Experts, resolve_impl
from syncless.demo.model import MoETransformer, init_weights
from syncless.demo.train import run_demo
from syncless.guard import SyncError, no_sync


def naive_moe(x, experts, weights, w_gate, w_up, w_down, kept=None):
    """Token by token, choice by choice: sum_k w_k * SwiGLU_{e_k}(x), over the kept
    (token, choice) pairs (all when ``kept`` is None)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            if kept is not None and not kept[t][j]:
                continue
            e = int(experts[t, j])
            h = F.silu(x[t] @ w_gate[e]) * (x[t] @ w_up[e])
            out[t] += weights[t, j] * (h @ w_down[e])
    return out


def _case(seed=0, t=37, d=8, h=12, n=5, k=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g)
    experts = torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(t)])
    experts[:10, 0], experts[:10, 1] = 0, 1  # experts 0 and 1 crowded; another may get none
    weights = torch.rand(t, k, generator=g)
    params = [torch.randn(n, d, h, generator=g) * 0.3, torch.randn(n, d, h, generator=g) * 0.3,
              torch.randn(n, h, d, generator=g) * 0.3]  # fmt: skip
    return x, experts, weights, params


def _run(impl, x, experts, weights, params, capacity_factor=0.0):
    n, d, h = params[0].shape
    fn = Experts(n, d, h, impl=impl, capacity_factor=capacity_factor)
    with torch.no_grad():
        for p, value in zip(fn.parameters(), params, strict=True):
            p.copy_(value)
    x = x.clone().requires_grad_(True)
    out = LocalDispatcher()(x, experts, weights, fn)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * probe).sum().backward()
    return out, [x.grad] + [p.grad for p in fn.parameters()], probe, fn


def _reference(x, experts, weights, params, probe, kept=None):
    x = x.clone().requires_grad_(True)
    ws = [p.clone().requires_grad_(True) for p in params]
    out = naive_moe(x, experts, weights, *ws, kept=kept)
    (out * probe).sum().backward()
    return out, [x.grad] + [w.grad for w in ws]


@pytest.mark.parametrize("impl", ["grouped", "padded", "loop"])
def test_every_impl_matches_the_token_by_token_reference(impl):
    x, experts, weights, params = _case()
    out, grads, probe, _ = _run(impl, x, experts, weights, params)
    ref, ref_grads = _reference(x, experts, weights, params, probe)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_grouped_in_bf16_matches_the_reference_within_bf16_rounding():
    x, experts, weights, params = _case(t=64, d=16, h=32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, grads, probe, _ = _run("grouped", x, experts, weights, params)
    ref, ref_grads = _reference(x, experts, weights, params, probe)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.1)


def test_padded_under_a_capacity_drops_the_late_rows_of_a_full_expert_and_counts_them():
    x, experts, weights, params = _case()
    t, k = experts.shape
    n = params[0].shape[0]
    factor = 1.0
    capacity = -(-int(factor * t * k / n) // GROUP_ALIGN) * GROUP_ALIGN  # 74/5 -> 15 -> 16
    # Independent ground truth: an expert keeps its first `capacity` rows in (token,
    # choice) order, the order the stable sort by expert leaves them in.
    seen = [0] * n
    kept = []
    for row in experts.tolist():
        kept.append([])
        for e in row:
            kept[-1].append(seen[e] < capacity)
            seen[e] += 1
    dropped = sum(max(0, c - capacity) for c in seen)
    assert dropped > 0  # the case crowds experts 0 and 1 past the capacity

    out, grads, probe, fn = _run("padded", x, experts, weights, params, capacity_factor=factor)
    ref, ref_grads = _reference(x, experts, weights, params, probe, kept=kept)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert int(fn.dropped_rows) == dropped


def test_an_expert_with_no_rows_gets_a_zero_gradient_not_none():
    d, h, n = 8, 12, 3
    for impl in ("grouped", "padded"):
        fn = Experts(n, d, h, impl=impl)
        torch.nn.init.normal_(fn.w_gate), torch.nn.init.normal_(fn.w_up)
        torch.nn.init.normal_(fn.w_down)
        out = fn(torch.randn(0, d), torch.zeros(n, dtype=torch.int64))
        assert out.shape == (0, d)
        out.sum().backward()
        assert all(p.grad is not None and not p.grad.any() for p in fn.parameters())


def test_auto_picks_grouped_on_the_cpu_and_padded_where_grouped_would_sync():
    cpu = torch.device("cpu")
    assert resolve_impl("auto", cpu, torch.float32) == "grouped"
    # fp32 on a GPU: torch._grouped_mm would loop over offs.cpu(), a sync per call.
    assert resolve_impl("auto", torch.device("cuda"), torch.float32) == "padded"
    assert resolve_impl("loop", cpu, torch.float32) == "loop"


@pytest.mark.parametrize("impl", ["grouped", "padded"])
def test_the_model_trains_a_step_under_no_sync(impl):
    cfg = preset("tiny", expert_impl=impl)
    model = MoETransformer(cfg)
    init_weights(model, seed=0)
    tokens = torch.randint(0, 256, (2, cfg.seq_len))
    with no_sync():  # forward and backward: a would-be sync raises
        logits, balance = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + 0.01 * balance
        loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_the_loop_impl_drains_and_says_so_under_no_sync():
    model = MoETransformer(preset("tiny", expert_impl="loop"))
    init_weights(model, seed=0)
    with no_sync() as guard:
        model(torch.randint(0, 256, (2, 16)))
    assert len(guard.allowed) == 2  # one count drain per MoE layer, allowed and recorded
    assert "--expert-impl loop" in guard.allowed[0].reason


def test_a_whole_demo_run_has_no_unintended_sync(tmp_path):
    with no_sync():  # the loop, the step log, the optimizer: everything the demo runs
        result = run_demo(preset("tiny", steps=3), run_dir=tmp_path / "r", quiet=True)
    assert [s for s, _ in result.losses] == [0, 1, 2]


def test_no_sync_is_not_vacuous_here():
    with pytest.raises(SyncError), no_sync():
        torch.ones(2).sum().item()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_auto_runs_without_a_sync_and_matches_the_loop():
    """bf16 autocast on CUDA: ``auto`` (grouped on sm90/sm100, else padded) under
    ``no_sync()``, which adds torch.cuda.set_sync_debug_mode("error"), against the loop."""
    device = torch.device("cuda")
    g = torch.Generator(device).manual_seed(0)
    t, d, h, n, k = 4096, 256, 512, 8, 2
    x = torch.randn(t, d, device=device, generator=g)
    experts = torch.rand(t, n, device=device, generator=g).topk(k, dim=-1).indices
    weights = torch.rand(t, k, device=device, generator=g)
    params = [torch.randn(n, d, h, device=device, generator=g) * 0.05,
              torch.randn(n, d, h, device=device, generator=g) * 0.05,
              torch.randn(n, h, d, device=device, generator=g) * 0.05]  # fmt: skip
    results = {}
    for impl in ("auto", "loop"):
        with torch.device(device):
            fn = Experts(n, d, h, impl=impl)
        with torch.no_grad():
            for p, value in zip(fn.parameters(), params, strict=True):
                p.copy_(value)
        xi = x.clone().requires_grad_(True)
        guard = no_sync() if impl == "auto" else torch.enable_grad()
        with guard, torch.autocast("cuda", dtype=torch.bfloat16):
            out = LocalDispatcher()(xi, experts, weights, fn)
            out.float().square().sum().backward()
        results[impl] = (out.float(), xi.grad, [p.grad for p in fn.parameters()])
    (out, x_grad, grads), (ref, ref_x_grad, ref_grads) = results["auto"], results["loop"]
    torch.testing.assert_close(out, ref, rtol=0.02, atol=0.02)
    torch.testing.assert_close(x_grad, ref_x_grad, rtol=0.05, atol=0.05)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05)
