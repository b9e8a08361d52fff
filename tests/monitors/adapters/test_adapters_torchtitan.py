"""The torchtitan adapter on tiny llama3, qwen3, qwen3 MoE and deepseek_v3 models built
from their config dataclasses (no download, CPU), eager and inside torchtitan's own
wrappers: activation checkpointing, per-block compile, FSDP2 on 2 gloo ranks.

Ground truth is taken outside the adapter: q/k re-run from the attention's projections,
QK-norm and torchtitan's RoPE module on the attention input a test hook captured; the
attention output rebuilt from q, k, the site's scale and an independently taken v; router
logits as the gate weight applied to the MoE input; the routing map as a one-hot of the
router's own ``topk_expert_ids``; block outputs from test hooks. Every adapter and
monitor hook runs under ``no_sync()`` (HookGuard).
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("torchtitan")

from torchtitan.distributed.activation_checkpoint import FullAC
from torchtitan_harness import DIM, FAMILIES, B, L, build_model, tokens

from syncless.errors import UsageError
from syncless.monitors import attach, build
from syncless.monitors.adapters import (
    TorchtitanAttentionSite,
    TorchtitanRouterSite,
    find_layers,
)


@pytest.fixture(autouse=True, params=["torch"])
def kernel_backend(request, monkeypatch):
    """One kernel backend, torch: the adapter tests do not depend on it (the recount of
    every monitor asks for triton too, with ``indirect``)."""
    from syncless import kernels

    if request.param == "triton" and not (kernels.triton_importable() and kernels.interpreting()):
        pytest.skip("needs triton and TRITON_INTERPRET=1 (CPU-only machines)")
    monkeypatch.setenv("SYNCLESS_KERNELS", request.param)
    previous = kernels.backend()
    kernels.set_backend(request.param)
    yield request.param
    kernels.set_backend(previous)


class Truth:
    """Test-owned hooks on one model: attention and MoE inputs, inner attention v and
    output, router ids, block outputs (registered before the adapter's)."""

    def __init__(self, model: nn.Module) -> None:
        self.attn_in: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.attn_out: dict[int, torch.Tensor] = {}
        self.moe_in: dict[int, torch.Tensor] = {}
        self.ids: dict[int, torch.Tensor] = {}
        self.out: dict[int, list[torch.Tensor]] = {}
        for key, block in model.layers.items():
            i, inner = int(key), _inner(block)
            attn = inner.attention
            attn.register_forward_pre_hook(partial(self._keep, self.attn_in, i, 0))
            attn.inner_attention.register_forward_pre_hook(partial(self._keep, self.v, i, 2))
            attn.inner_attention.register_forward_hook(partial(self._keep_out, self.attn_out, i))
            block.register_forward_hook(partial(self._append_out, i))
            moe = getattr(inner, "moe", None)
            if moe is not None:
                moe.register_forward_pre_hook(partial(self._keep, self.moe_in, i, 0))
                moe.router.register_forward_hook(partial(self._keep_ids, i))

    @staticmethod
    def _keep(store, i, index, module, args):
        store.setdefault(i, args[index].detach().clone())

    @staticmethod
    def _keep_out(store, i, module, args, output):
        store.setdefault(i, output.detach().clone())

    def _keep_ids(self, i, module, args, output):
        self.ids.setdefault(i, output[1].detach().clone())

    def _append_out(self, i, module, args, output):
        self.out.setdefault(i, []).append(output.detach().clone())

    def routing_map(self, i: int, n_experts: int) -> torch.Tensor:
        ids = self.ids[i].reshape(-1, self.ids[i].shape[-1])
        return F.one_hot(ids, n_experts).sum(1).bool()


def _inner(block: nn.Module) -> nn.Module:
    return getattr(block, "_checkpoint_wrapped_module", block)


def recount_qk(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GQA q/k from the attention input: projections, QK-norm, torchtitan's RoPE."""
    with torch.no_grad():
        q, k, _ = attn.qkv_linear(x)
        if attn.q_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = attn.rope(q, k, None)
    return q.transpose(1, 2), k.transpose(1, 2)


def naive_probs(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax(q k^T * scale) from q [B,H,L,D], k [B,KV,L,D], in float64."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1)


def attention_output(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[B, L, heads, Dv] from probs [B,H,L,L] and v [B, L, KV, Dv] (kv heads repeated)."""
    v = v.transpose(1, 2).double().repeat_interleave(probs.shape[1] // v.shape[2], dim=1)
    return (probs @ v).transpose(1, 2)


# --- the map ------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_map_reports_the_models_config(family: str) -> None:
    model = build_model(family)
    mm = find_layers(model)
    assert mm.adapter == "torchtitan" and len(mm) == 2 and mm.d_model == DIM
    for i, (site, block) in enumerate(zip(mm.layers, model.layers.values(), strict=True)):
        assert site.index == i and site.block is block
        att = site.attention
        assert isinstance(att, TorchtitanAttentionSite) and att.module is block.attention
        assert att.causal and att.sliding_window is None and att.total_heads is None
        if family == "deepseek_v3":  # MLA: k expanded to every head, qk head 16 + 8
            assert (att.n_heads, att.n_kv_heads, att.head_dim) == (4, 4, 24)
            assert att.scale == pytest.approx(block.attention.softmax_scale)
        else:
            kv, head_dim = {"llama3": (2, 16), "qwen3": (2, 32), "qwen3-moe": (1, 16)}[family]
            assert (att.n_heads, att.n_kv_heads, att.head_dim) == (4, kv, head_dim)
            assert att.scale == pytest.approx(head_dim**-0.5)
        moe = getattr(block, "moe", None)
        if moe is None:
            assert site.router is None and site.mlp is block.feed_forward
            continue
        r = site.router
        assert isinstance(r, TorchtitanRouterSite) and site.mlp is moe
        assert r.module is moe.router and r.logits_module is moe.router.gate and r.routing_map
        score, normalize = ("sigmoid", False) if family == "deepseek_v3" else ("softmax", True)
        assert (r.n_experts, r.top_k, r.score, r.normalize_topk) == (4, 2, score, normalize)
    expected_moe = {"llama3": [], "qwen3": [], "qwen3-moe": [0, 1], "deepseek_v3": [1]}[family]
    assert [r.layer for r in mm.routers] == expected_moe


def test_pipeline_stages_keep_their_global_layer_ids() -> None:
    model = build_model("llama3")
    first, second = copy.deepcopy(model), copy.deepcopy(model)
    del first.layers["1"], second.layers["0"]  # what pipeline splitting does: keys stay
    assert [s.index for s in find_layers(second).layers] == [1]
    # chunks without offsets, consecutive or not: the keys already are the global ids
    assert [s.index for s in find_layers([first, second]).layers] == [0, 1]
    assert [s.index for s in find_layers([second]).layers] == [1]
    assert [s.index for s in find_layers(second, layer_offsets=[1]).layers] == [1]
    # keys that cannot be global ids (below the chunk's first layer): the offset is added
    assert [s.index for s in find_layers(model, layer_offsets=[4]).layers] == [4, 5]


def test_a_model_without_layer_ids_is_not_taken() -> None:
    model = build_model("llama3")
    model.layers = nn.ModuleDict({"first": model.layers["0"]})
    with pytest.raises(UsageError, match=r"torchtitan: model\.layers"):
        find_layers(model)


# --- the hooks, eager -----------------------------------------------------------


def _attach_all_sites(mm, captured: dict[str, dict[int, list]]) -> None:
    for site in mm.layers:
        i = site.index
        site.attention.attach_qk(lambda q, k, i=i: captured["qk"].setdefault(i, []).append((q, k)))
        site.attach_output(lambda h, i=i: captured["out"].setdefault(i, []).append(h))
        if site.router is not None:
            site.router.attach_logits(lambda t, i=i: captured["logits"].setdefault(i, []).append(t))
            site.router.attach_routing(
                lambda t, m, i=i: captured["routing"].setdefault(i, []).append((t, m))
            )


@pytest.mark.parametrize("family", FAMILIES)
def test_hooks_hand_over_what_the_model_computed(family: str, hook_guard) -> None:
    model = build_model(family)
    truth = Truth(model)
    mm = find_layers(model)
    hook_guard.snapshot(model)
    captured: dict[str, dict[int, list]] = {"qk": {}, "out": {}, "logits": {}, "routing": {}}
    _attach_all_sites(mm, captured)
    assert hook_guard.guard(model) > 0
    with torch.no_grad():
        model(tokens())
    assert hook_guard.calls > 0

    for site in mm.layers:
        i, att = site.index, site.attention
        assert len(captured["qk"][i]) == len(captured["out"][i]) == 1  # once per forward
        q, k = captured["qk"][i][0]
        assert q.shape == (B, att.n_heads, L, att.head_dim)
        assert k.shape == (B, att.n_kv_heads, L, att.head_dim)
        if family != "deepseek_v3":
            want_q, want_k = recount_qk(att.module, truth.attn_in[i])
            torch.testing.assert_close(q, want_q, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(k, want_k, rtol=1e-6, atol=1e-6)
        # the site's q, k, scale and causal mask rebuild what the attention returned
        got = attention_output(naive_probs(q, k, att.scale), truth.v[i])
        torch.testing.assert_close(got, truth.attn_out[i].double(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(captured["out"][i][0], truth.out[i][0])
        if site.router is None:
            assert i not in captured["logits"] and i not in captured["routing"]
            continue
        r = site.router
        want = F.linear(truth.moe_in[i].reshape(-1, DIM), r.logits_module.weight)
        (logits,), ((routed_logits, routing),) = captured["logits"][i], captured["routing"][i]
        torch.testing.assert_close(logits, want)
        torch.testing.assert_close(routed_logits, want)
        assert routing.dtype == torch.bool and routing.shape == (B * L, r.n_experts)
        assert torch.equal(routing, truth.routing_map(i, r.n_experts))
        assert torch.equal(routing.sum(1), torch.full((B * L,), r.top_k))


def test_the_routing_map_is_the_routers_choice_not_a_top_k_of_its_scores(hook_guard) -> None:
    """deepseek_v3 with an expert bias and group-limited routing: a top-k of the scores
    picks other experts for some tokens; the routing map follows the router."""
    model = build_model("deepseek_v3")
    truth = Truth(model)
    site = find_layers(model).layers[1].router
    hook_guard.snapshot(model)
    got = []
    site.attach_routing(lambda logits, routing: got.append((logits, routing)))
    hook_guard.guard(model)
    with torch.no_grad():
        model(tokens())
    logits, routing = got[0]
    naive = F.one_hot(logits.sigmoid().topk(site.top_k, dim=-1).indices, 4).sum(1).bool()
    assert not torch.equal(routing, naive)
    assert torch.equal(routing, truth.routing_map(1, 4))


# --- every monitor, against recounts --------------------------------------------


def _recount(model: nn.Module, ids: torch.Tensor) -> dict[str, float]:
    """The monitors' per-layer values, recounted on ``model`` (an unwrapped copy)."""
    truth = Truth(model)
    with torch.no_grad():
        model(ids)
    mm = find_layers(model)  # the static facts only: scale, heads, experts
    want: dict[str, float] = {}
    for site in mm.layers:
        scope, i, att = f"monitors/layer_{site.index:02d}", site.index, site.attention
        q_in, k_in = _qk_truth(att.module, truth, i)
        probs = naive_probs(q_in, k_in, att.scale)
        scores = probs.clamp_min(1e-300)  # masked entries: 0 * log 0 = 0
        entropy = -(probs * scores.log()).sum(-1)  # [B, H, L]
        k_rep = k_in.repeat_interleave(att.n_heads // att.n_kv_heads, dim=1).double()
        logits = (q_in.double() @ k_rep.transpose(-1, -2)) * att.scale
        causal = torch.ones(L, L, dtype=torch.bool).tril()
        logit_max = logits.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))
        for h in range(att.n_heads):
            want[f"{scope}/attn_qk_logit_max/head_{h}"] = float(logit_max[h])
            want[f"{scope}/attn_entropy_nats/head_{h}"] = float(entropy[:, h].mean())
        want[f"{scope}/act_absmax"] = float(truth.out[i][0].abs().max())
        if site.router is not None:
            counts = truth.routing_map(i, site.router.n_experts).sum(0)
            for e, n in enumerate(counts.tolist()):
                want[f"{scope}/moe_tokens_count/expert_{e}"] = float(n)
    return want


def _qk_truth(attn: nn.Module, truth: Truth, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(attn, "qkv_linear"):
        return recount_qk(attn, truth.attn_in[i])
    # MLA: q, k as deepseek_v3's Attention.forward builds them, from its own modules
    x = truth.attn_in[i]
    with torch.no_grad():
        q = attn.wq(x).view(B, L, -1, attn.qk_head_dim)
        q_nope, q_pe = q.split([attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
        kv, k_pe = attn.wkv_a(x).split([attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = attn.rope(q_pe, k_pe.unsqueeze(2), None)
        kv = attn.wkv_b(attn.kv_norm(kv)).view(B, L, -1, attn.qk_nope_head_dim + attn.v_head_dim)
        k_nope = kv[..., : attn.qk_nope_head_dim]
        k = torch.cat([k_nope, k_pe.expand(-1, -1, k_nope.shape[2], -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
    return q.transpose(1, 2), k.transpose(1, 2)


def _records(model: nn.Module, ids: torch.Tensor, hook_guard=None) -> dict[str, float]:
    """Every monitor's records of one training step of ``model`` on ``ids``; the hooks
    run under no_sync() when a HookGuard is given."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    if hook_guard is not None:
        hook_guard.snapshot(model)
    handle = attach(model, build("all", optimizer=opt), run=None, budget=None, lagged=False)
    if hook_guard is not None:
        assert hook_guard.guard(model) > 0
    out = model(ids)
    out.float().square().mean().backward()
    opt.step()
    records = {r.name: r.value for r in handle.step(0)}
    handle.close()
    return records


def _check(records: dict[str, float], want: dict[str, float]) -> None:
    assert want
    for name, value in want.items():
        assert records[name] == pytest.approx(value, rel=1e-4, abs=1e-5), name


@pytest.mark.parametrize("family", ["qwen3", "qwen3-moe", "deepseek_v3"])
@pytest.mark.parametrize("kernel_backend", ["torch", "triton"], indirect=True)
def test_all_monitors_recount_on_eager_models(family, kernel_backend, hook_guard) -> None:
    model = build_model(family)
    want = _recount(copy.deepcopy(model), tokens())
    _check(_records(model, tokens(), hook_guard), want)


# --- inside torchtitan's wrappers -------------------------------------------------


def test_monitors_recount_under_torchtitans_full_activation_checkpointing(hook_guard) -> None:
    model = build_model("qwen3-moe")
    want = _recount(copy.deepcopy(model), tokens())
    FullAC.Config().build().apply(model)
    assert all(hasattr(b, "_checkpoint_wrapped_module") for b in model.layers.values())
    records = _records(model, tokens(), hook_guard)
    _check(records, want)  # the recompute's second hook calls were skipped, not counted
    assert records["monitors/self/moe_recompute_skipped_count"] > 0


def _compile_blocks(model: nn.Module) -> None:
    """torchtitan's apply_compile: each block compiled in place, fullgraph (a graph
    break in a hook would raise)."""
    for block in model.layers.values():
        block.compile(backend="aot_eager", fullgraph=True)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["compile", "ac+compile"])
def test_monitors_recount_with_torchtitans_per_block_compile(checkpointed) -> None:
    """Attached before the first compiled call, the hooks are traced into the blocks'
    graphs and the values still recount. No HookGuard: no_sync() itself cannot be
    traced; the eager tests run the same hooks under it."""
    torch._dynamo.reset()
    model = build_model("qwen3-moe")
    want = _recount(copy.deepcopy(model), tokens())
    if checkpointed:  # torchtitan's order: AC, then compile
        FullAC.Config().build().apply(model)
    _compile_blocks(model)
    with _titan_dynamo_config():
        _check(_records(model, tokens()), want)


def _titan_dynamo_config():
    """The dynamo settings torchtitan's apply_compile makes (globally; here for the
    test's duration): MoE dispatch has data-dependent shapes, and the hooks' Python
    side effects are not replayed in a checkpointed block's recompute."""
    return torch._dynamo.config.patch(
        capture_scalar_outputs=True, skip_fwd_side_effects_in_bwd_under_checkpoint=True
    )


def _fsdp2_rank(rank: int, world: int) -> dict[str, Any]:
    """One gloo rank: torchtitan's AC, per-block compile and apply_fsdp_to_decoder
    (float32 parameters and reductions), then one step on this rank's batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    model = build_model("qwen3-moe")
    # the monitors' values are cluster-wide: recount on both ranks' batches at once
    want = _recount(copy.deepcopy(model), torch.cat([tokens(1), tokens(2)]))
    FullAC.Config().build().apply(model)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    apply_fsdp_to_decoder(
        model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False
    )
    for module in model.modules():  # gloo has no PREMUL_SUM (torchtitan's divide factor 1)
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    records = _records(model, tokens(1 + rank), _hook_guard_class()())
    return {"records": records, "want": want}


def _hook_guard_class() -> type:
    """conftest's HookGuard, in a spawned rank (no fixture there; the module of that
    name on sys.path may be another directory's conftest)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "_adapter_conftest", Path(__file__).with_name("conftest.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.HookGuard


@pytest.mark.dist
def test_monitors_recount_on_two_fsdp2_ranks_with_activation_checkpointing() -> None:
    from syncless.testing import spawn_gloo

    for out in spawn_gloo(_fsdp2_rank, 2, timeout_s=240):
        _check(out["records"], out["want"])
