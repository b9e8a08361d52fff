"""The Hugging Face adapter on tiny random models of each family (no download).

Ground truth for q/k is the model's own eager attention: with
``attn_implementation="eager"`` and ``output_attentions=True`` the model returns the
softmax it computed, which the captured (post-RoPE) q/k, the site's scale and a causal
mask must reproduce. Router logits are recomputed from the MoE input and the router
weight; block outputs are compared with ``output_hidden_states``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from syncless.monitors.adapters import HFAttentionSite, find_layers  # noqa: E402

B, L, VOCAB = 2, 7, 64
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    attn_implementation="eager",
)
MOE: dict[str, Any] = dict(num_experts_per_tok=2, output_router_logits=False)

# family -> (model class name, config class name, extra config)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "llama-base": ("LlamaModel", "LlamaConfig", {"num_key_value_heads": 4}),
    "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {"num_key_value_heads": 1}),
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 4, **MOE}),
    "qwen2-moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        {
            "num_hidden_layers": 3,
            "num_experts": 5,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 24,
            "decoder_sparse_step": 2,  # layer 1 is sparse, layers 0 and 2 dense
            "norm_topk_prob": True,
            **MOE,
        },
    ),
    # a close relative, matched by structure: q_norm/k_norm between projection and RoPE
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 16}),
}


def build(family: str, **overrides: Any) -> torch.nn.Module:
    model_cls, config_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **overrides})
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # random norms so a skipped q_norm/k_norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, L), generator=torch.Generator().manual_seed(1))


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.model.layers if hasattr(model, "model") else model.layers


def sparse_layers(config: Any) -> list[bool]:
    n = config.num_hidden_layers
    if hasattr(config, "num_local_experts"):
        return [True] * n
    if hasattr(config, "decoder_sparse_step"):
        return [(i + 1) % config.decoder_sparse_step == 0 for i in range(n)]
    return [False] * n


@pytest.mark.parametrize("family", list(FAMILIES))
def test_map_reports_the_config(family: str) -> None:
    model = build(family)
    cfg = model.config
    mm = find_layers(model)
    assert mm.adapter == "huggingface"
    assert len(mm) == cfg.num_hidden_layers and mm.d_model == cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    for i, (site, block, sparse) in enumerate(
        zip(mm.layers, decoder_layers(model), sparse_layers(cfg), strict=True)
    ):
        assert site.index == i and site.block is block and site.mlp is block.mlp
        att = site.attention
        assert isinstance(att, HFAttentionSite) and att.module is block.self_attn
        assert (att.n_heads, att.n_kv_heads, att.head_dim) == (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            head_dim,
        )
        assert att.scale == pytest.approx(head_dim**-0.5) and att.causal
        assert att.sliding_window is None
        if not sparse:
            assert site.router is None
            continue
        r = site.router
        n_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
        assert r is not None and r.module is block.mlp.gate
        assert (r.n_experts, r.top_k, r.score, r.normalize_topk) == (
            n_experts,
            cfg.num_experts_per_tok,
            "softmax",
            True,
        )


def softmax_reference(q, k, scale, window=None):
    """Eager attention probabilities from q [B,H,L,D], k [B,KV,L,D] (kv heads repeated)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    i = torch.arange(q.shape[2])[:, None]
    j = torch.arange(k.shape[2])[None, :]
    masked = j > i
    if window is not None:
        masked |= i - j >= window
    return scores.masked_fill(masked, float("-inf")).float().softmax(-1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hooks_reproduce_the_model(family: str, hook_guard) -> None:
    model = build(family)
    mm = find_layers(model)
    mlp_in = {}
    for i, block in enumerate(decoder_layers(model)):
        block.mlp.register_forward_pre_hook(lambda m, a, i=i: mlp_in.__setitem__(i, a[0]))
    hook_guard.snapshot(model)
    qk, logits, hidden = {}, {}, {}
    for site in mm.layers:
        i = site.index
        site.attention.attach_qk(lambda q, k, i=i: qk.setdefault(i, []).append((q, k)))
        site.attach_output(lambda h, i=i: hidden.setdefault(i, []).append(h))
        if site.router is not None:
            site.router.attach_logits(lambda t, i=i: logits.setdefault(i, []).append(t))
    assert hook_guard.guard(model) > 0
    with torch.no_grad():
        out = model(ids(), output_attentions=True, output_hidden_states=True)
    assert hook_guard.calls > 0

    n = len(mm)
    for site in mm.layers:
        i = site.index
        assert len(qk[i]) == len(hidden[i]) == 1  # once per forward
        q, k = qk[i][0]
        att = site.attention
        assert q.shape == (B, att.n_heads, L, att.head_dim)
        assert k.shape == (B, att.n_kv_heads, L, att.head_dim)
        torch.testing.assert_close(
            softmax_reference(q, k, att.scale), out.attentions[i], rtol=1e-5, atol=1e-6
        )
        # hidden_states = (embeddings, layer 0, ..., layer n-2, norm(layer n-1))
        want = out.hidden_states[i + 1]
        got = hidden[i][0] if i < n - 1 else model.get_decoder().norm(hidden[i][0])
        torch.testing.assert_close(got, want)
        if site.router is None:
            assert i not in logits
            continue
        assert len(logits[i]) == 1
        flat = mlp_in[i].reshape(-1, mm.d_model)
        torch.testing.assert_close(logits[i][0], F.linear(flat, site.router.module.weight))
        assert logits[i][0].shape == (B * L, site.router.n_experts)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_rotary_hook_hands_unrotated_qk_the_models_rotation_turns_into_attach_qks(
    family: str, hook_guard
) -> None:
    model = build(family)
    site = find_layers(model).layers[1].attention
    assert site.rotate_half  # checked at registration against the formula
    hook_guard.snapshot(model)
    got, want = [], []
    site.attach_qk_rotary(lambda q, k, rotary: got.append((q, k, rotary)))
    site.attach_qk(lambda q, k: want.append((q, k)))
    hook_guard.guard(model)
    with torch.no_grad():
        model(ids())
    (q, k, rotary), (want_q, want_k) = got[0], want[0]
    assert rotary is not None and rotary.cos.shape == (1, L, site.head_dim)
    assert q.shape == want_q.shape and not torch.equal(q, want_q)  # not rotated yet
    rotated_q, rotated_k = rotary.rotated(q, k)
    assert torch.equal(rotated_q, want_q) and torch.equal(rotated_k, want_k)


def test_another_rotation_convention_is_not_taken_for_rotate_half() -> None:
    from syncless.monitors.adapters.hf_qk import is_rotate_half

    def interleaved(q, k, cos, sin):  # GPT-J / GLM style: pairs (0, 1), (2, 3), ...
        def turn(x):
            return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)

        return (q * cos[:, None] + turn(q) * sin[:, None],
                k * cos[:, None] + turn(k) * sin[:, None])  # fmt: skip

    model_rope = type(build("llama").model.layers[0].self_attn).__module__
    import sys

    assert is_rotate_half(sys.modules[model_rope].apply_rotary_pos_emb)
    assert not is_rotate_half(interleaved)
    assert not is_rotate_half(lambda q, k: (q, k))  # another signature


def test_qk_with_sdpa_reproduce_the_attention_output(hook_guard) -> None:
    """Under the default SDPA kernel (no attention weights): rebuild the output from q/k."""
    model = build("llama", attn_implementation="sdpa")
    site = find_layers(model).layers[1]
    att = site.attention.module
    seen = {}
    att.register_forward_hook(lambda m, a, o: seen.__setitem__("out", o[0]))
    att.v_proj.register_forward_hook(lambda m, a, o: seen.__setitem__("v", o))
    hook_guard.snapshot(model)
    site.attention.attach_qk(lambda q, k: seen.__setitem__("qk", (q, k)))
    hook_guard.guard(model)
    with torch.no_grad():
        model(ids())
    q, k = seen["qk"]
    v = seen["v"].view(B, L, -1, site.attention.head_dim).transpose(1, 2)
    probs = softmax_reference(q, k, site.attention.scale)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    out = (probs @ v).transpose(1, 2).reshape(B, L, -1) @ att.o_proj.weight.T
    torch.testing.assert_close(seen["out"], out, rtol=1e-5, atol=1e-6)


def test_sliding_window_is_reported_and_matches_the_mask(hook_guard) -> None:
    model = build("mistral", sliding_window=3)
    mm = find_layers(model)
    assert [s.attention.sliding_window for s in mm.layers] == [3, 3]
    hook_guard.snapshot(model)
    seen = []
    mm.layers[0].attention.attach_qk(lambda q, k: seen.append((q, k)))
    hook_guard.guard(model)
    with torch.no_grad():
        out = model(ids(), output_attentions=True)
    q, k = seen[0]
    want = softmax_reference(q, k, mm.layers[0].attention.scale, window=3)
    torch.testing.assert_close(want, out.attentions[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen2-moe"])
def test_handles_remove_every_hook(family: str, hook_guard) -> None:
    model = build(family)
    hook_guard.snapshot(model)
    handles = []
    for site in find_layers(model).layers:
        handles += site.attention.attach_qk(lambda q, k: None)
        handles += site.attach_output(lambda h: None)
        if site.router is not None:
            handles += site.router.attach_logits(lambda t: None)
    assert hook_guard.added(model)
    for h in handles:
        h.remove()
    assert hook_guard.added(model) == set()
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_training_step_with_hooks(hook_guard) -> None:
    """Hooks stay out of autograd: gradients equal those of an unhooked step."""
    model = build("mixtral").train()
    x = ids()
    model(x, labels=x).loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    hook_guard.snapshot(model)
    seen = []
    for site in find_layers(model).layers:
        site.attention.attach_qk(lambda q, k: seen.append(q.requires_grad or k.requires_grad))
        site.router.attach_logits(lambda t: seen.append(t.requires_grad))
    hook_guard.guard(model)
    model(x, labels=x).loss.backward()
    assert seen == [False] * 4
    for n, p in model.named_parameters():
        if n in want:
            torch.testing.assert_close(p.grad, want[n])


def test_a_stock_forward_and_backward_run_under_no_sync() -> None:
    """Issue #20: Hugging Face's rotary embedding moves inv_freq to the input's device
    every forward (a same-device no-op), which no_sync used to report as a host copy."""
    from syncless.guard import no_sync

    model = build("llama", attn_implementation="sdpa").train()
    with no_sync(cpu_as_device=True):
        model(ids(), labels=ids()).loss.backward()
