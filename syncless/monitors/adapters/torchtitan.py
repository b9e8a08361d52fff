"""Adapter for torchtitan decoders (0.3): llama3, qwen3, qwen3 MoE, deepseek_v3 and
models built on ``torchtitan.models.common.decoder.Decoder`` the same way.

Recognised by structure, without importing torchtitan: ``model.layers`` is a
``ModuleDict`` keyed by layer id, each block has an ``attention`` module with an
``inner_attention`` submodule and ``n_heads``, and a ``feed_forward`` or a ``moe``
(``router.gate``, ``router.top_k``, ``router.num_experts``). Blocks may be wrapped by
torchtitan's ``checkpoint_wrapper``, compiled in place or sharded with ``fully_shard``.

Layer numbers are the ``ModuleDict`` keys: torchtitan keeps the global layer ids as
keys when a pipeline stage drops the other layers, so every stage numbers its layers
as the whole model does. ``first_layer`` is added only when the keys cannot be global
ids (the smallest key is below it: chunks built with their own keys from 0).

q/k capture: every attention (GQA, MLA) hands q, k, v to ``inner_attention`` (SDPA,
flex or varlen) as ``[B, L, heads, head_dim]``, after RoPE, QK-norm and MLA's
concatenation, kv heads not repeated. A forward-pre-hook on ``inner_attention`` takes
them from its arguments and transposes them: nothing is recomputed.

Routing: the router picks experts by top-k of ``scores + expert_bias`` (and, with
expert groups, within the best groups), not of the scores alone, so the router site
also hands over the router's own choice (``attach_routing``): a one-hot of its
``topk_expert_ids``, built with a scatter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils.hooks import RemovableHandle

from syncless.errors import UsageError
from syncless.monitors.adapters._modules import get_path, unwrap
from syncless.monitors.adapters.sites import (
    AttentionSite,
    LayerSite,
    ModelMap,
    QKCallback,
    RouterSite,
    RoutingCallback,
    TensorCallback,
)

_ROUTER_ATTRS = ("gate", "top_k", "num_experts", "score_func")
# Parameters holding the query heads: TP shards them by head along dim 0.
_QUERY_WEIGHTS = ("wq.weight", "wqkv.weight", "wq_b.weight")


@dataclass
class TorchtitanAttentionSite(AttentionSite):
    """torchtitan attention: q/k are the first two arguments of ``inner_attention``."""

    def attach_qk(self, callback: QKCallback) -> list[RemovableHandle]:
        inner: nn.Module = self.module.inner_attention  # type: ignore[assignment]
        return [inner.register_forward_pre_hook(_make_qk_hook(callback), with_kwargs=True)]


@dataclass
class TorchtitanRouterSite(RouterSite):
    """torchtitan ``TokenChoiceTopKRouter``: logits from ``gate``, the experts chosen
    from the router's ``topk_expert_ids`` (output 1)."""

    def attach_logits(self, callback: TensorCallback) -> list[RemovableHandle]:
        gate = self.logits_module if self.logits_module is not None else self.module
        return [gate.register_forward_hook(_make_logits_hook(callback, self.n_experts))]

    def attach_routing(self, callback: RoutingCallback) -> list[RemovableHandle]:
        gate = self.logits_module if self.logits_module is not None else self.module
        kept: list[Tensor] = []  # this forward's logits, until the router returns
        return [
            gate.register_forward_hook(_make_logits_hook(kept.append, self.n_experts)),
            self.module.register_forward_hook(
                _make_routing_hook(kept, callback, self.n_experts, self.top_k)
            ),
        ]


class TorchtitanAdapter:
    """Maps torchtitan decoders (llama3, qwen3, qwen3 MoE, deepseek_v3, ...)."""

    name = "torchtitan"
    looked_for = (
        "model.layers (ModuleDict keyed by layer id) of blocks with .attention (having "
        ".inner_attention and n_heads) and .feed_forward or .moe (.router with "
        f"{', '.join(_ROUTER_ATTRS)})"
    )

    def matches(self, model: nn.Module) -> bool:
        blocks = _blocks(model)
        return bool(blocks) and all(_is_block(b) for _, b in blocks)  # type: ignore[union-attr]

    def map(self, model: nn.Module, first_layer: int = 0) -> ModelMap:
        blocks = _blocks(model) or []
        # Global ids as keys (torchtitan, pipeline stages too): take them as they are.
        offset = 0 if min(key for key, _ in blocks) >= first_layer else first_layer
        layers = [_map_block(block, offset + key) for key, block in blocks]
        return ModelMap(adapter=self.name, layers=layers, d_model=_d_model(model, blocks))


def _blocks(model: nn.Module) -> list[tuple[int, nn.Module]] | None:
    layers = get_path(model, "layers")
    if not isinstance(layers, nn.ModuleDict):
        return None
    items = [(key, block) for key, block in layers.items() if block is not None]
    if not all(key.isdigit() for key, _ in items):
        return None  # not layer ids: some other model keeps a ModuleDict of layers
    return [(int(key), block) for key, block in items]


def _is_block(block: nn.Module) -> bool:
    inner = unwrap(block)
    attn = getattr(inner, "attention", None)
    mlp = _mlp_of(inner)
    return (
        isinstance(attn, nn.Module)
        and isinstance(getattr(attn, "inner_attention", None), nn.Module)
        and hasattr(attn, "n_heads")
        and mlp is not None
    )


def _mlp_of(inner: nn.Module) -> nn.Module | None:
    # qwen3 / deepseek_v3 blocks have either .moe or .feed_forward; llama3 feed_forward.
    moe = getattr(inner, "moe", None)
    if isinstance(moe, nn.Module):
        return moe
    ffn = getattr(inner, "feed_forward", None)
    return ffn if isinstance(ffn, nn.Module) else None


def _d_model(model: nn.Module, blocks: list[tuple[int, nn.Module]]) -> int:
    dim = getattr(getattr(model, "config", None), "dim", None)
    if dim is None:  # no Decoder config: the width the first block normalises
        norm = getattr(unwrap(blocks[0][1]), "attention_norm", None)
        shape = getattr(norm, "normalized_shape", None)
        dim = shape[0] if shape else None
    if dim is None:
        raise UsageError(
            f"torchtitan adapter: {type(model).__name__} has no config.dim and its first "
            "block no attention_norm.normalized_shape: the model width is unknown"
        )
    return int(dim)


def _map_block(block: nn.Module, index: int) -> LayerSite:
    inner = unwrap(block)
    mlp = _mlp_of(inner)
    return LayerSite(
        index=index,
        block=block,
        attention=_attention_site(inner.attention, index),  # type: ignore[arg-type]
        router=_router_site(mlp, index),
        mlp=mlp,
    )


def _attention_site(attn: nn.Module, index: int) -> TorchtitanAttentionSite:
    n_heads = int(attn.n_heads)  # type: ignore[arg-type]
    # GQA keeps n_kv_heads; MLA expands its shared rope key to every head.
    n_kv = int(getattr(attn, "n_kv_heads", None) or n_heads)
    head_dim = int(getattr(attn, "head_dim", None) or attn.qk_head_dim)  # type: ignore[arg-type]
    # GQA passes `scaling` (None: SDPA's head_dim**-0.5), MLA its `softmax_scale`.
    scale = getattr(attn, "scaling", None) or getattr(attn, "softmax_scale", None)
    window, causal = _window(attn)
    tp_size, tp_rank = _tensor_parallel(attn)
    if n_heads % tp_size or n_kv % tp_size:
        raise UsageError(
            f"torchtitan adapter: layer {index} has {n_heads} query / {n_kv} key heads, "
            f"not divisible by its tensor-parallel degree {tp_size}"
        )
    local = n_heads // tp_size
    return TorchtitanAttentionSite(
        layer=index,
        module=attn,
        n_heads=local,
        n_kv_heads=n_kv // tp_size,
        head_dim=head_dim,
        scale=float(scale or head_dim**-0.5),
        causal=causal,
        sliding_window=window,
        head_offset=tp_rank * local,
        total_heads=n_heads if tp_size > 1 else None,
    )


def _window(attn: nn.Module) -> tuple[int | None, bool]:
    """(sliding window with the query itself, causal) of the attention's kernel."""
    # varlen: window_size=(left, right); (-1, 0) causal, (W, 0) W keys back, (-1, -1) full
    left, right = getattr(attn.inner_attention, "window_size", (-1, 0))
    if right != 0:
        return None, False
    # gpt-oss style: sliding_window_size on the attention (a flex mask)
    size = getattr(attn, "sliding_window_size", None)
    if left >= 0:
        return left + 1, True
    return (int(size) if size else None), True


def _tensor_parallel(attn: nn.Module) -> tuple[int, int]:
    """(degree, rank) of the mesh dim named "tp" that shards the query heads."""
    for name, param in attn.named_parameters():
        if not (name.endswith(_QUERY_WEIGHTS) and isinstance(param, DTensor)):
            continue
        mesh = param.device_mesh
        names = mesh.mesh_dim_names or ()
        if "tp" in names:
            dim = names.index("tp")
            placement = param.placements[dim]
            if isinstance(placement, Shard) and placement.dim == 0:
                return mesh.size(dim), mesh.get_local_rank(dim)
    return 1, 0


def _router_site(mlp: nn.Module | None, index: int) -> TorchtitanRouterSite | None:
    router = getattr(mlp, "router", None)
    if not isinstance(router, nn.Module):
        return None  # a dense layer
    missing = [a for a in _ROUTER_ATTRS if not hasattr(router, a)]
    if missing:
        raise UsageError(
            f"torchtitan adapter: layer {index}'s router {type(router).__name__} has no "
            f"{', '.join(missing)}; the adapter knows TokenChoiceTopKRouter"
        )
    if router.score_func not in ("softmax", "sigmoid"):
        raise UsageError(
            f"torchtitan adapter: layer {index}'s router scores with "
            f"{router.score_func!r}; supported: softmax, sigmoid"
        )
    return TorchtitanRouterSite(
        layer=index,
        module=router,
        n_experts=int(router.num_experts),  # type: ignore[arg-type]
        top_k=int(router.top_k),  # type: ignore[arg-type]
        score=str(router.score_func),
        normalize_topk=bool(getattr(router, "route_norm", False)),
        logits_module=router.gate,  # type: ignore[arg-type]
        routing_map=True,
    )


def _local(t: Any) -> Tensor:
    # Under tensor parallelism activations are DTensors: the rank's own shard (a type
    # check, fixed by the parallelisation; to_local is a view, no collective).
    return t.to_local() if isinstance(t, DTensor) else t


def _make_qk_hook(
    callback: QKCallback,
) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
    def qk_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # torchtitan's attentions pass q, k, v positionally: [B, L, heads, head_dim]
        q = args[0] if len(args) > 1 else kwargs["q_BLNH"]
        k = args[1] if len(args) > 1 else kwargs["k_BLNH"]
        callback(_local(q).detach().transpose(1, 2), _local(k).detach().transpose(1, 2))

    return qk_hook


def _make_logits_hook(
    callback: TensorCallback, n_experts: int
) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
    def logits_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        callback(_local(output).detach().reshape(-1, n_experts))

    return logits_hook


def _make_routing_hook(
    kept: list[Tensor], callback: RoutingCallback, n_experts: int, top_k: int
) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
    def routing_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        # output = (topk_scores, topk_expert_ids, scores); the ids are the router's
        # choice, bias and group limits included
        experts = _local(output[1]).detach().reshape(-1, top_k)
        chosen = torch.zeros(
            experts.shape[0], n_experts, dtype=torch.bool, device=experts.device
        ).scatter_(1, experts, True)
        callback(kept.pop(), chosen)

    return routing_hook
