"""The demo-model adapter against a naive re-implementation of the demo's attention."""

from __future__ import annotations

import math

import pytest
import torch

from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.guard import SyncError
from syncless.monitors.adapters import DemoAttentionSite, find_layers

N_LAYERS, D, HEADS, EXPERTS, TOP_K, B, L = 3, 32, 4, 6, 2, 2, 9


@pytest.fixture
def model() -> MoETransformer:
    cfg = preset(
        "tiny",
        n_layers=N_LAYERS,
        d_model=D,
        n_heads=HEADS,
        n_experts=EXPERTS,
        top_k=TOP_K,
        expert_hidden=16,
        seq_len=16,
    )
    m = MoETransformer(cfg)
    init_weights(m, seed=3)
    with torch.no_grad():  # larger than the 0.02 init so attention is far from uniform
        for layer in m.layers:
            for proj in (layer.attn.q_proj, layer.attn.k_proj):
                proj.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(7))
    return m


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (B, L), generator=torch.Generator().manual_seed(0))


def heads(t: torch.Tensor) -> torch.Tensor:
    """[B, L, D] -> [B, HEADS, L, D / HEADS]."""
    return t.view(B, L, HEADS, D // HEADS).transpose(1, 2)


def naive_rope(x: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[2i], x[2i+1]) of head position p by p * 10000^(-2i/D)."""
    *_, seq, dh = x.shape
    out = torch.empty_like(x)
    for p in range(seq):
        for i in range(dh // 2):
            theta = p * 10_000.0 ** (-2 * i / dh)
            c, s = math.cos(theta), math.sin(theta)
            a, b = x[..., p, 2 * i], x[..., p, 2 * i + 1]
            out[..., p, 2 * i] = a * c - b * s
            out[..., p, 2 * i + 1] = a * s + b * c
    return out


def test_map_reports_the_config(model: MoETransformer) -> None:
    mm = find_layers(model)
    assert mm.adapter == "syncless-demo"
    assert mm.d_model == D and len(mm) == N_LAYERS
    for i, (site, block) in enumerate(zip(mm.layers, model.layers, strict=True)):
        assert site.index == i and site.block is block and site.mlp is block.moe
        att = site.attention
        assert isinstance(att, DemoAttentionSite) and att.module is block.attn
        assert (att.layer, att.n_heads, att.n_kv_heads, att.head_dim) == (
            i,
            HEADS,
            HEADS,
            D // HEADS,
        )
        assert att.scale == pytest.approx((D // HEADS) ** -0.5) and att.causal
        r = site.router
        assert r is not None and r.module is block.moe.router
        assert (r.layer, r.n_experts, r.top_k, r.score, r.normalize_topk) == (
            i,
            EXPERTS,
            TOP_K,
            "softmax",
            True,
        )
        assert {id(p) for p in site.parameters()} == {id(p) for p in block.parameters()}


def test_qk_logits_output_match_a_naive_reference(model: MoETransformer, hook_guard) -> None:
    mm = find_layers(model)
    # Reference inputs/outputs, recorded by the test's own (unguarded) hooks.
    attn_in, attn_out, moe_in = {}, {}, {}
    for i, block in enumerate(model.layers):
        block.attn.register_forward_hook(lambda m, a, o, i=i: attn_in.__setitem__(i, a[0]))
        block.attn.register_forward_hook(lambda m, a, o, i=i: attn_out.__setitem__(i, o))
        block.moe.register_forward_pre_hook(lambda m, a, i=i: moe_in.__setitem__(i, a[0]))
    hook_guard.snapshot(model)

    qk, logits, hidden = {}, {}, {}
    for site in mm.layers:
        i = site.index
        site.attention.attach_qk(lambda q, k, i=i: qk.setdefault(i, []).append((q, k)))
        site.router.attach_logits(lambda t, i=i: logits.setdefault(i, []).append(t))
        site.attach_output(lambda h, i=i: hidden.setdefault(i, []).append(h))
    assert hook_guard.guard(model) == N_LAYERS * 4  # attention pre, rotary, router, output
    x_tokens = tokens()
    with torch.no_grad():
        model(x_tokens)
    assert hook_guard.calls == N_LAYERS * (3 + 2)  # the rotary hook fires twice per forward

    for i, block in enumerate(model.layers):
        assert len(qk[i]) == len(logits[i]) == len(hidden[i]) == 1  # once per forward
        q, k = qk[i][0]
        x = attn_in[i]
        torch.testing.assert_close(q, naive_rope(heads(x @ block.attn.q_proj.weight.T)))
        torch.testing.assert_close(k, naive_rope(heads(x @ block.attn.k_proj.weight.T)))
        # These q/k, the site's scale and causal flag reproduce the attention's output.
        v = heads(x @ block.attn.v_proj.weight.T)
        scores = (q @ k.transpose(-1, -2)) * mm.layers[i].attention.scale
        scores = scores.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
        out = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, L, D)
        torch.testing.assert_close(attn_out[i], out @ block.attn.o_proj.weight.T)
        # Router logits: the gate applied to the MoE input, tokens flattened.
        flat = moe_in[i].reshape(B * L, D)
        torch.testing.assert_close(logits[i][0], flat @ block.moe.router.gate.weight.T)
        assert logits[i][0].shape == (B * L, EXPERTS)

    # Block outputs: a manual forward through the blocks, hooks removed.
    for handle_owner in model.modules():
        handle_owner._forward_hooks.clear()
        handle_owner._forward_pre_hooks.clear()
    with torch.no_grad():
        h = model.embed(x_tokens)
        for i, block in enumerate(model.layers):
            h = block(h)[0]
            torch.testing.assert_close(hidden[i][0], h)


def test_handles_remove_every_hook(model: MoETransformer, hook_guard) -> None:
    hook_guard.snapshot(model)
    handles = []
    for site in find_layers(model).layers:
        handles += site.attention.attach_qk(lambda q, k: None)
        handles += site.router.attach_logits(lambda t: None)
        handles += site.attach_output(lambda h: None)
    assert len(hook_guard.added(model)) > 0
    for h in handles:
        h.remove()
    assert hook_guard.added(model) == set()


def test_hooks_keep_training_gradients_unchanged(model: MoETransformer, hook_guard) -> None:
    x = tokens()
    logits, balance = model(x)
    (logits.square().mean() + balance).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    hook_guard.snapshot(model)
    seen = []
    for site in find_layers(model).layers:
        site.attention.attach_qk(lambda q, k: seen.append(q.requires_grad or k.requires_grad))
    hook_guard.guard(model)
    logits, balance = model(x)
    (logits.square().mean() + balance).backward()
    assert seen == [False] * N_LAYERS  # callbacks get detached tensors
    for p, g in zip(model.parameters(), want, strict=True):
        torch.testing.assert_close(p.grad, g)


def test_guard_catches_a_syncing_callback(model: MoETransformer, hook_guard) -> None:
    """The hooks' guard is live: a callback that reads a value back fails."""
    hook_guard.snapshot(model)
    find_layers(model).layers[0].attention.attach_qk(lambda q, k: q.max().item())
    hook_guard.guard(model)
    with pytest.raises(SyncError), torch.no_grad():
        model(tokens())


def test_changed_attention_forward_is_reported(model: MoETransformer) -> None:
    """If the attention stops calling rotary exactly twice, the hook says so (no bad q/k)."""
    find_layers(model).layers[0].attention.attach_qk(lambda q, k: None)
    attn = model.layers[0].attn

    def forward_with_three_rotations(x: torch.Tensor) -> torch.Tensor:
        t = x.view(B, L, HEADS, D // HEADS).transpose(1, 2)
        attn.rotary(attn.rotary(attn.rotary(t)))
        return x

    attn.forward = forward_with_three_rotations
    with pytest.raises(RuntimeError, match="rotary module ran 3 times"):
        attn(torch.zeros(B, L, D))
