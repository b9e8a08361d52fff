"""The nn.MultiheadAttention adapter against the module's own attention weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from syncless.monitors.adapters import (
    MHAAttentionSite,
    MultiheadAttentionAdapter,
    find_layers,
)

E, H, B, L, S = 16, 4, 2, 5, 6


def softmax_of(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    return ((q @ k.transpose(-1, -2)) * scale).softmax(-1)


def module_weights(mha: nn.MultiheadAttention, query, key, value) -> torch.Tensor:
    """The per-head attention probabilities the module itself computes."""
    _, w = mha(query, key, value, need_weights=True, average_attn_weights=False)
    return w if w.dim() == 4 else w.unsqueeze(0)


CASES = {
    "batch-first": (dict(batch_first=True), (B, L, E), (B, L, E)),
    "time-first": (dict(), (L, B, E), (L, B, E)),
    "unbatched": (dict(), (L, E), (L, E)),
    "cross-kdim": (dict(batch_first=True, kdim=8, vdim=12), (B, L, E), None),
    "bias-kv-zero-attn": (dict(add_bias_kv=True, add_zero_attn=True), (L, B, E), (S, B, E)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_qk_reproduce_the_module_attention(case: str, hook_guard) -> None:
    kwargs, q_shape, k_shape = CASES[case]
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(E, H, **kwargs).eval()
    if mha.bias_k is not None:
        nn.init.normal_(mha.bias_k)
    with torch.no_grad():
        mha.in_proj_bias.normal_()  # non-zero biases, so a dropped bias would show
    g = torch.Generator().manual_seed(1)
    query = torch.randn(q_shape, generator=g)
    if k_shape is None:  # separate key/value widths: a cross-attention call
        key, value = torch.randn(B, S, 8, generator=g), torch.randn(B, S, 12, generator=g)
    else:
        key = value = torch.randn(k_shape, generator=g) if k_shape != q_shape else query

    mm = find_layers(mha)
    assert mm.adapter == "torch-mha" and len(mm) == 1 and mm.d_model == E
    site = mm.layers[0].attention
    assert isinstance(site, MHAAttentionSite) and site.module is mha
    assert (site.n_heads, site.n_kv_heads, site.head_dim) == (H, H, E // H)
    assert not site.causal and mm.layers[0].block is mha and mm.layers[0].router is None

    hook_guard.snapshot(mha)
    seen = []
    site.attach_qk(lambda q, k: seen.append((q, k)))
    hook_guard.guard(mha)
    with torch.no_grad():
        want = module_weights(mha, query, key, value)
    assert len(seen) == 1 and hook_guard.calls == 1
    q, k = seen[0]
    assert q.shape[:2] == (want.shape[0], H) and q.shape[-1] == E // H
    torch.testing.assert_close(softmax_of(q, k, site.scale), want, rtol=1e-5, atol=1e-6)


def test_transformer_encoder_layers_and_outputs(hook_guard) -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False).eval()
    mm = find_layers(model)
    assert len(mm) == 3 and [s.index for s in mm.layers] == [0, 1, 2]
    for site, block in zip(mm.layers, model.layers, strict=True):
        assert site.block is block and site.attention.module is block.self_attn
        assert site.mlp is None  # linear1/linear2 are not one module
    hook_guard.snapshot(model)
    outs, qks = [], []
    for site in mm.layers:
        site.attach_output(outs.append)
        site.attention.attach_qk(lambda q, k: qks.append((q, k)))
    hook_guard.guard(model)
    x = torch.randn(B, L, E)
    with torch.no_grad():
        model(x)
        h = x  # manual forward, with the hooks still on (they do not change values)
        for i, block in enumerate(model.layers):
            w = module_weights(block.self_attn, h, h, h)
            q, k = qks[i]
            torch.testing.assert_close(softmax_of(q, k, mm.layers[i].attention.scale), w)
            h = block(h)
            torch.testing.assert_close(outs[i], h)


def test_decoder_cross_attention_is_skipped_and_causal_is_configurable() -> None:
    model = nn.TransformerDecoder(nn.TransformerDecoderLayer(E, H, 32), 2)
    mm = find_layers(model)
    assert [s.attention.module for s in mm.layers] == [b.self_attn for b in model.layers]
    assert [s.block for s in mm.layers] == list(model.layers)
    assert not any(s.attention.causal for s in mm.layers)
    causal = MultiheadAttentionAdapter(causal=True).map(model, first_layer=4)
    assert [s.index for s in causal.layers] == [4, 5]
    assert all(s.attention.causal and s.attention.layer == s.index for s in causal.layers)


def test_shared_block_falls_back_to_the_attention_module() -> None:
    class TwoAttn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.MultiheadAttention(E, H)
            self.b = nn.MultiheadAttention(E, H)

    model = nn.Sequential(TwoAttn())
    mm = find_layers(model)
    assert [s.block for s in mm.layers] == [model[0].a, model[0].b]


def test_handles_remove_every_hook(hook_guard) -> None:
    layer = nn.TransformerEncoderLayer(E, H, 32, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    hook_guard.snapshot(model)
    handles = []
    for site in find_layers(model).layers:
        handles += site.attention.attach_qk(lambda q, k: None) + site.attach_output(print)
    assert hook_guard.added(model)
    for h in handles:
        h.remove()
    assert hook_guard.added(model) == set()
