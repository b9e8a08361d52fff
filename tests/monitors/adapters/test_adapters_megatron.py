"""The Megatron-core adapter on tiny GPTModels (local layer spec, CPU, one gloo rank).

Ground truth is recomputed here, independently of the adapter: q and k from the
attention's own projections with a plain rotate-half RoPE written in this file, the
attention statistics by a float64 softmax, the expert counts from the routing map the
router returned (a plain forward hook), and the channel maxima from the block outputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("megatron.core")

from megatron_harness import Parallel, batch, gpt_config, gpt_model, single_process

from syncless.monitors import attach, build
from syncless.monitors.adapters import MegatronAdapter, find_layers

SEQ = 16


def rotate_half_rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``t * cos + rotate_half(t) * sin`` over the first ``freqs.shape[-1]`` channels."""
    d = freqs.shape[-1]
    head, rest = t[..., :d], t[..., d:]
    first, second = head.chunk(2, dim=-1)
    turned = torch.cat((-second, first), dim=-1)
    return torch.cat((head * freqs.cos() + turned * freqs.sin(), rest), dim=-1)


class Truth:
    """Plain hooks that keep what each layer saw: attention inputs, router outputs,
    block outputs (copies, on the test's side of the model)."""

    def __init__(self, model: nn.Module) -> None:
        self.qk: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.routing: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.handles = []
        for block in model.decoder.layers:
            index = block.layer_number - 1
            attention = block.self_attention
            self.handles.append(
                attention.register_forward_pre_hook(self._attention(index), with_kwargs=True)
            )
            self.handles.append(block.register_forward_hook(self._output(index)))
            router = getattr(block.mlp, "router", None)
            if router is not None:
                self.handles.append(router.register_forward_hook(self._router(index)))

    def _attention(self, index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            with torch.no_grad():
                q, k, _ = module.get_query_key_value_tensors(args[0])
                freqs = kwargs["rotary_pos_emb"]
                q_freqs, k_freqs = freqs if isinstance(freqs, tuple) else (freqs, freqs)
                q = rotate_half_rope(q, q_freqs[: q.shape[0]])
                k = rotate_half_rope(k, k_freqs[: k.shape[0]])
            # [s, b, heads, d] -> [b, heads, s, d]
            self.qk[index] = (q.permute(1, 2, 0, 3).clone(), k.permute(1, 2, 0, 3).clone())

        return hook

    def _router(self, index: int):
        def hook(module: nn.Module, args: tuple, output: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            logits = x.double() @ module.weight.detach().double().T
            self.routing[index] = (logits, output[1].detach().clone())

        return hook

    def _output(self, index: int):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.outputs[index] = output[0].detach().clone()

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, scale: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per query head: the largest causal logit and the mean row entropy, float64."""
    q, k = q.double(), k.double()
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    logits = q @ k.transpose(-1, -2) * scale
    seq = q.shape[2]
    allowed = torch.ones(seq, seq, dtype=torch.bool).tril()
    logits = logits.masked_fill(~allowed, -torch.inf)
    top = logits.amax(dim=(0, 2, 3))
    p = logits.softmax(dim=-1)
    entropy = -(torch.where(allowed, p * p.clamp_min(1e-300).log(), 0.0)).sum(-1)
    return top.numpy(), entropy.mean(dim=(0, 2)).numpy()


def _train_step(model: nn.Module, seed: int) -> None:
    tokens, positions, labels, mask = batch(seed, seq=SEQ)
    loss = model(tokens, positions, mask, labels=labels)
    loss.float().mean().backward()


@pytest.fixture
def world():
    with single_process(Parallel()):
        yield


def test_the_adapter_maps_megatron_layers_by_their_global_layer_number(world):
    config = gpt_config(layers=3, heads=4, query_groups=2, experts=4)
    model = gpt_model(config)
    mapped = find_layers(model)
    assert mapped.adapter == MegatronAdapter.name
    assert [layer.index for layer in mapped] == [0, 1, 2]
    site = mapped.layers[1].attention
    assert (site.n_heads, site.n_kv_heads, site.head_dim, site.global_heads) == (4, 2, 16, 4)
    assert site.causal and site.sliding_window is None and site.scale == pytest.approx(0.25)
    router = mapped.layers[0].router
    assert (router.n_experts, router.top_k, router.score, router.routing_map) == (
        4, 2, "softmax", True,
    )  # fmt: skip
    assert mapped.d_model == 64


def test_captured_q_and_k_are_the_rotated_projections_the_softmax_sees(world):
    model = gpt_model(gpt_config(layers=2, heads=4, query_groups=2))
    truth = Truth(model)
    captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = []
    for site in find_layers(model).attention:

        def keep(q, k, layer=site.layer):
            captured[layer] = (q.clone(), k.clone())

        handles += site.attach_qk(keep)
    tokens, positions, _, mask = batch(1, seq=SEQ)
    with torch.no_grad():
        model(tokens, positions, mask)
    for h in handles:
        h.remove()
    truth.remove()
    for layer, (q, k) in captured.items():
        want_q, want_k = truth.qk[layer]
        assert q.shape == (2, 4, SEQ, 16) and k.shape == (2, 2, SEQ, 16)
        torch.testing.assert_close(q, want_q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k, want_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("experts", [None, 4], ids=["dense", "moe"])
def test_every_monitor_on_a_megatron_gpt_equals_an_independent_recount(world, hook_guard, experts):
    config = gpt_config(layers=2, heads=4, query_groups=2, experts=experts)
    model = gpt_model(config)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    truth = Truth(model)
    hook_guard.snapshot(model)
    handle = attach(model, build("all", optimizer=opt), lagged=False, budget=None)
    # Megatron's own forward reads back on the CPU: the guard wraps syncless's hooks
    # and the router's gating wrapper, not the model.
    assert hook_guard.guard(model) > 0
    for block in model.decoder.layers:
        wrapper = getattr(block.mlp, "router", nn.Module()).__dict__.get("gating")
        if wrapper is not None:
            wrapper.on_logits = hook_guard._wrap(wrapper.on_logits)
    _train_step(model, seed=2)
    opt.step()
    records = {r.name: r.value for r in handle.step(0)}
    readout = handle.readouts[-1]
    handle.close()
    truth.remove()

    for layer in range(2):
        scope = f"monitors/layer_{layer:02d}"
        q, k = truth.qk[layer]
        top, entropy = naive_attention(q, k, scale=0.25)
        np.testing.assert_allclose(readout.get(f"{scope}/attn_qk_logit_max"), top, rtol=1e-5)
        np.testing.assert_allclose(readout.get(f"{scope}/attn_entropy_nats"), entropy, rtol=1e-5)
        hidden = truth.outputs[layer]
        absmax = hidden.abs().reshape(-1, hidden.shape[-1]).amax(dim=0).double().numpy()
        np.testing.assert_allclose(readout.get(f"{scope}/act_channel_absmax"), absmax, rtol=1e-6)
        assert records[f"{scope}/nonfinite_count"] == 0
        params = [p for p in model.decoder.layers[layer].parameters()]
        want_norm = float(torch.sqrt(sum(p.detach().double().square().sum() for p in params)))
        assert records[f"{scope}/param_norm"] == pytest.approx(want_norm, rel=1e-6)
        if experts is None:
            assert f"{scope}/moe_tokens_count" not in readout.values
            continue
        logits, routing_map = truth.routing[layer]
        counts = routing_map.sum(dim=0).double().numpy()
        np.testing.assert_array_equal(readout.get(f"{scope}/moe_tokens_count"), counts)
        assert counts.sum() == 2 * SEQ * 2  # every token chose top_k experts
        lse = torch.logsumexp(logits, dim=-1)
        assert records[f"{scope}/moe_router_zloss"] == pytest.approx(
            float(lse.square().mean()), rel=1e-5
        )
        mass = (logits.softmax(-1) * routing_map).sum(-1).mean()
        assert records[f"{scope}/moe_topk_prob_mass"] == pytest.approx(float(mass), rel=1e-5)


def test_the_router_wrapper_is_removed_with_the_hooks(world):
    model = gpt_model(gpt_config(layers=1, experts=4))
    router = model.decoder.layers[0].mlp.router
    handle = attach(model, build("moe"), lagged=False, budget=None)
    assert "gating" in router.__dict__
    handle.close()
    assert "gating" not in router.__dict__
    assert router.gating.__func__ is type(router).gating


def test_the_transformer_engine_spec_maps_as_the_local_one(world):
    pytest.importorskip(
        "transformer_engine",
        reason="TransformerEngine is not installed (it needs CUDA and builds against it; "
        "neither the CPU machines nor the H200 image have it): the TE layer spec is "
        "mapped by the same attributes, untested here",
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    config = gpt_config(layers=2, heads=4, query_groups=2)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_with_transformer_engine_spec(),
        vocab_size=128,
        max_sequence_length=SEQ,
    )
    mapped = find_layers(model)
    assert mapped.adapter == MegatronAdapter.name and [s.index for s in mapped] == [0, 1]
    site = mapped.layers[0].attention
    assert (site.n_heads, site.n_kv_heads, site.head_dim) == (4, 2, 16)


def test_grouped_gemm_experts_count_as_the_sequential_ones(world):
    pytest.importorskip(
        "grouped_gemm",
        reason="Megatron's grouped experts need the grouped_gemm package (CUDA only, built "
        "from source) or TransformerEngine: the router and its routing map, which the "
        "MoE monitor reads, are the same module as with sequential experts",
    )
    model = gpt_model(gpt_config(layers=1, experts=4, moe_grouped_gemm=True))
    truth = Truth(model)
    handle = attach(model, build("moe"), lagged=False, budget=None)
    _train_step(model, seed=3)
    readout = handle.step(0) and handle.readouts[-1]
    handle.close()
    truth.remove()
    counts = truth.routing[0][1].sum(dim=0).double().numpy()
    np.testing.assert_array_equal(readout.get("monitors/layer_00/moe_tokens_count"), counts)
