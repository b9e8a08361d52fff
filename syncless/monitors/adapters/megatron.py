"""Adapter for Megatron-core ``GPTModel`` and the model chunks of its virtual pipeline.

Recognised by structure, without importing megatron: ``decoder.layers[i]`` blocks
(``TransformerLayer``) with a ``layer_number``, ``self_attention.core_attention`` and a
``config`` holding ``num_attention_heads``; wrappers that keep the model at ``.module``
(Megatron's ``DistributedDataParallel``, ``Float16Module``) are looked through.

- **Layer numbers** are Megatron's own: ``layer_number`` is global and 1-based on every
  pipeline stage and virtual chunk, so layer ``i`` here is ``layer_number - 1`` and a
  list of chunks needs no offsets.
- **q and k**: a forward-pre-hook on ``core_attention`` (``DotProductAttention``, or
  TransformerEngine's ``TEDotProductAttention``) receives them after the rotary
  embedding, ``[s, b, heads, d]``, exactly as they enter the softmax; the hook hands
  them over as ``[b, heads, s, d]`` views. Nothing is recomputed.
- **Tensor parallelism**: a rank's q carries its ``heads / tp`` heads, a contiguous
  slice starting at ``tp_rank * heads / tp`` (``AttentionSite.head_offset``). Without
  sequence parallelism every tensor-parallel rank holds the same block output, so ranks
  other than the first are marked ``output_replica``; with it the output is split along
  the sequence and every rank measures its part.
- **Router**: ``TopKRouter`` computes its logits in ``gating()``, a plain method, then
  returns ``(probs, routing_map)``. The site wraps ``gating`` on the router instance
  (removed with the hooks) to keep the logits it computed, and a forward hook hands
  them over with the router's own ``routing_map``: tokens per expert are counted from
  the experts Megatron chose (expert bias, group-limited routing and capacity dropping
  included), not from a top-k recomputed here.

Not measured: attention under context parallelism (a rank's keys are a slice of the
sequence, so its logits are not the softmax's; the attention site is left out with a
warning) and packed sequences (``packed_seq_params``: calls are skipped). Refused:
Megatron's per-layer CUDA graphs (:func:`check_cuda_graphs`); one graph per iteration
(``cuda_graph_scope="full_iteration"``) captures the hooks with the rest.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from syncless.errors import UsageError
from syncless.monitors.adapters._modules import layer_list, unwrap
from syncless.monitors.adapters.sites import (
    AttentionSite,
    LayerSite,
    ModelMap,
    QKCallback,
    RouterSite,
    RoutingCallback,
    TensorCallback,
)

log = logging.getLogger(__name__)

_WRAPPER_DEPTH = 4  # DDP(Float16Module(GPTModel)) at most, in practice


@dataclass
class MegatronAttentionSite(AttentionSite):
    """Megatron attention: q/k are ``core_attention``'s first two arguments."""

    def attach_qk(self, callback: QKCallback) -> list[RemovableHandle]:
        hook = _make_core_attention_hook(callback)
        return [self.module.register_forward_pre_hook(hook, with_kwargs=True)]


@dataclass
class MegatronRouterSite(RouterSite):
    """``TopKRouter``: logits from its ``gating()``, the choice from its output."""

    def attach_logits(self, callback: TensorCallback) -> list[RemovableHandle]:
        n_experts = self.n_experts

        def on_logits(logits: Tensor) -> None:
            callback(logits.detach().reshape(-1, n_experts))

        return [_wrap_gating(self.module, on_logits)]

    def attach_routing(self, callback: RoutingCallback) -> list[RemovableHandle]:
        n_experts = self.n_experts
        # One forward's logits, from gating() to the router's output.
        pending: list[Tensor] = []

        def on_logits(logits: Tensor) -> None:
            pending.clear()
            pending.append(logits.detach().reshape(-1, n_experts))

        def routing_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            # A Python list's length, set by the model's code path: not a tensor value.
            if not pending:
                return  # gating() was not called in this forward (replaced by the user)
            logits = pending.pop()
            callback(logits, output[1].detach().reshape(-1, n_experts))

        return [
            _wrap_gating(self.module, on_logits),
            self.module.register_forward_hook(routing_hook),
        ]


class MegatronAdapter:
    """Maps Megatron-core ``GPTModel`` s (local and TransformerEngine layer specs)."""

    name = "megatron-core"
    looked_for = (
        "a GPTModel-like module (or one under .module wrappers) with decoder.layers[i] "
        "blocks that have layer_number, self_attention.core_attention and a config "
        "with num_attention_heads; MoE blocks: .mlp.router with gating()"
    )

    def matches(self, model: nn.Module) -> bool:
        return find_gpt(model) is not None

    def map(self, model: nn.Module, first_layer: int = 0) -> ModelMap:
        gpt = find_gpt(model)
        if gpt is None:
            raise UsageError(f"{type(model).__name__} is not a Megatron-core GPTModel")
        check_cuda_graphs(gpt.config)
        blocks = layer_list(gpt.decoder.layers) or []  # type: ignore[union-attr]
        config = gpt.config
        # ``first_layer`` is not added: Megatron numbers its layers globally already.
        layers = [_map_block(block, config) for block in blocks]
        return ModelMap(
            adapter=self.name,
            layers=layers,
            d_model=int(config.hidden_size),
            param_layout=param_layout,
        )


def check_cuda_graphs(config: Any) -> None:
    """A ``UsageError`` for Megatron-core's per-layer CUDA graphs (megatron-core 0.16).

    ``cuda_graph_impl="local"`` gives each ``TransformerLayer`` a ``CudaGraphManager``
    unless ``cuda_graph_scope`` is ``full_iteration``. Its graphs break the monitors
    three ways. ``create_fwd_graph`` runs each layer ``cuda_graph_warmup_steps`` more
    times, eagerly, on zero inputs: the hooks would count them into the first step.
    At every replay, ``call_ddp_preforward_hook`` asserts that no module of the layer
    has a forward pre-hook but Megatron DDP's, and the attention site is one. And a
    capture of one layer ends before a grouped launch over all layers completes.
    ``"transformer_engine"`` graphs each layer too (``make_graphed_callables``, after
    warm-up iterations on sample inputs). One graph per iteration (``full_iteration``,
    ``megatron.core.full_cuda_graph.FullCudaGraphWrapper``) captures the hooks with the
    whole forward and backward: supported.
    """
    impl = str(getattr(config, "cuda_graph_impl", "none") or "none")
    if impl == "none" or graphs_per_iteration(config):
        return
    names = _graph_scopes(config)
    todo = (
        "Use cuda_graph_impl='local' with cuda_graph_scope='full_iteration' (one graph per "
        "iteration, megatron.core.full_cuda_graph.FullCudaGraphWrapper: the hooks are "
        "captured with it), or cuda_graph_impl='none'"
    )
    if impl == "transformer_engine":
        raise UsageError(
            "syncless monitors: cuda_graph_impl='transformer_engine' is not supported. "
            "TransformerEngine's make_graphed_callables captures each layer in graphs of "
            "its own, after warm-up iterations on sample inputs that the monitors would "
            "count into a step. " + todo
        )
    raise UsageError(
        f"syncless monitors: Megatron-core's per-layer CUDA graphs "
        f"(cuda_graph_impl={impl!r}, cuda_graph_scope={','.join(names) or 'full'!r}) are not "
        "supported. Creating them re-runs each layer "
        f"{getattr(config, 'cuda_graph_warmup_steps', 3)} times on zero inputs "
        "(cuda_graph_warmup_steps), which the monitors would count into the first step. "
        "Each replay asserts that no module of a layer has a forward pre-hook but "
        "Megatron DDP's; the attention monitor reads q and k from one on core_attention. "
        "And a monitor's grouped launch over all layers cannot complete inside one layer's "
        "graph. " + todo
    )


def graphs_per_iteration(config: Any) -> bool:
    """Whether ``config`` asks for one CUDA graph per training iteration
    (``cuda_graph_impl="local"``, ``cuda_graph_scope="full_iteration"``)."""
    impl = getattr(config, "cuda_graph_impl", "none")
    return impl == "local" and "full_iteration" in _graph_scopes(config)


def _graph_scopes(config: Any) -> list[str]:
    """``cuda_graph_scope`` by name (``CudaGraphScope`` members after ``__post_init__``)."""
    scopes = getattr(config, "cuda_graph_scope", None) or []
    if isinstance(scopes, str):
        scopes = scopes.split(",")
    return [str(getattr(scope, "name", scope)) for scope in scopes]


def param_layout(p: Tensor) -> Any:
    """How Megatron laid ``p`` out, from the attributes it sets on its parameters
    (cold path, once per parameter at attach).

    Expert weights (``allreduce=False``) differ across expert-parallel ranks and repeat
    on each expert-data-parallel rank; tensor-parallel weights (``tensor_model_parallel``)
    differ across tensor-parallel ranks and repeat on each data- and context-parallel
    rank; the rest (norms, routers) is the same everywhere. The norms monitor sums the
    first two over ranks and divides by the repeats (the metrics' group is the world).
    """
    from megatron.core import parallel_state

    from syncless.monitors.norms_sharding import REPLICATED, Layout

    if not parallel_state.model_parallel_is_initialized():
        return None
    if getattr(p, "allreduce", True) is False:
        return Layout(True, parallel_state.get_expert_data_parallel_world_size())
    if getattr(p, "tensor_model_parallel", False):
        dp = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
        return Layout(True, dp)
    return REPLICATED


def find_gpt(model: nn.Module) -> nn.Module | None:
    """The ``GPTModel`` (the module holding ``decoder.layers`` and ``config``) under
    ``.module`` wrappers, or None."""
    for _ in range(_WRAPPER_DEPTH):
        model = unwrap(model)
        blocks = layer_list(getattr(getattr(model, "decoder", None), "layers", None))
        config = getattr(model, "config", None)
        if blocks is not None and hasattr(config, "num_attention_heads"):
            if all(_is_megatron_block(b) for b in blocks):
                return model
            return None
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            return None
        model = inner
    return None


def _is_megatron_block(block: nn.Module) -> bool:
    inner = unwrap(block)
    attention = getattr(inner, "self_attention", None)
    return hasattr(inner, "layer_number") and isinstance(
        getattr(attention, "core_attention", None), nn.Module
    )


def _group_rank(group: Any) -> tuple[int, int]:
    """(rank, size) in a process group, (0, 1) outside torch.distributed."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _tp_group(attention: nn.Module) -> Any:
    pg = getattr(attention, "pg_collection", None)
    return getattr(pg, "tp", None) or getattr(attention, "tp_group", None)


def _map_block(block: nn.Module, config: Any) -> LayerSite:
    inner = unwrap(block)
    index = int(inner.layer_number) - 1  # type: ignore[arg-type]
    attention_module: nn.Module = inner.self_attention  # type: ignore[assignment]
    tp_rank, tp_size = _group_rank(_tp_group(attention_module))
    mlp = getattr(inner, "mlp", None)
    return LayerSite(
        index=index,
        block=block,
        attention=_attention(attention_module, config, index, tp_rank, tp_size),
        router=_router(mlp, config, index),
        mlp=mlp if isinstance(mlp, nn.Module) else None,
        output_replica=tp_size > 1 and not config.sequence_parallel and tp_rank > 0,
    )


def _attention(
    attention: nn.Module, config: Any, index: int, tp_rank: int, tp_size: int
) -> MegatronAttentionSite | None:
    if getattr(config, "context_parallel_size", 1) > 1:
        if index == 0:
            log.warning(
                "syncless megatron adapter: context parallelism splits each sequence's "
                "keys across ranks, so no rank sees a whole softmax: attention "
                "statistics are off for this model"
            )
        return None
    core: nn.Module = attention.core_attention  # type: ignore[assignment]
    n_heads, n_groups = int(config.num_attention_heads), int(config.num_query_groups or 0)
    n_groups = n_groups or n_heads
    if n_heads % tp_size or n_groups % tp_size:
        raise UsageError(
            f"layer {index}: {n_heads} heads and {n_groups} query groups do not split "
            f"over {tp_size} tensor-parallel ranks"
        )
    local_heads = n_heads // tp_size
    head_dim = _head_dim(core, config, n_heads)
    return MegatronAttentionSite(
        layer=index,
        module=core,
        n_heads=local_heads,
        n_kv_heads=n_groups // tp_size,
        head_dim=head_dim,
        scale=_scale(core, config, head_dim),
        causal=_causal(core),
        sliding_window=_window(core, config),
        head_offset=tp_rank * local_heads,
        total_heads=n_heads,
    )


def _head_dim(core: nn.Module, config: Any, n_heads: int) -> int:
    if getattr(config, "multi_latent_attention", False):
        return int(config.qk_head_dim + config.qk_pos_emb_head_dim)
    return int(
        getattr(core, "hidden_size_per_attention_head", None)
        or getattr(config, "kv_channels", None)
        or config.hidden_size // n_heads
    )


def _scale(core: nn.Module, config: Any, head_dim: int) -> float:
    """The factor on q·k before the softmax. The local ``DotProductAttention`` divides
    its ``softmax_scale`` by the layer number under ``apply_query_key_layer_scaling``
    and the fused softmax multiplies it back (``scale=coeff``): the product is what
    the softmax sees."""
    scale = getattr(core, "softmax_scale", None) or getattr(config, "softmax_scale", None)
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    softmax = getattr(core, "scale_mask_softmax", None)
    coeff = getattr(softmax, "scale", None)
    return float(scale) * (float(coeff) if coeff else 1.0)


def _causal(core: nn.Module) -> bool:
    mask_type = getattr(core, "attn_mask_type", None)
    # AttnMaskType.causal (and padding_causal): an enum member's name, not a tensor.
    return mask_type is None or "causal" in str(getattr(mask_type, "name", mask_type))


def _window(core: nn.Module, config: Any) -> int | None:
    """Megatron's ``window_size=(left, right)`` as keys seen per query, itself
    included; only causal windows (``right == 0``) are supported."""
    softmax = getattr(core, "scale_mask_softmax", None)
    window = getattr(softmax, "window_size", None)
    if window is None and getattr(config, "window_size", None) is not None:
        window = config.window_size if softmax is None else None
    if window is None:
        return None
    left, right = (int(w) for w in window)
    if right != 0 or left < 0:
        raise UsageError(
            f"megatron adapter: window_size={tuple(window)} is not a causal sliding "
            "window (right must be 0, left >= 0); attention statistics support those only"
        )
    return left + 1


def _router(mlp: Any, config: Any, index: int) -> MegatronRouterSite | None:
    router = getattr(mlp, "router", None)
    if not isinstance(router, nn.Module) or not callable(getattr(router, "gating", None)):
        return None
    n_experts, top_k = getattr(config, "num_moe_experts", None), getattr(router, "topk", None)
    if not n_experts or not top_k:
        raise UsageError(
            f"layer {index}: {type(router).__name__} has no expert count "
            "(config.num_moe_experts) or top-k (router.topk)"
        )
    score = str(getattr(config, "moe_router_score_function", "softmax"))
    return MegatronRouterSite(
        layer=index,
        module=router,
        n_experts=int(n_experts),
        top_k=int(top_k),
        score=score,
        # Sigmoid scores are renormalised over the top k; softmax ones unless the
        # softmax runs before the top-k (moe_router_pre_softmax).
        normalize_topk=score == "sigmoid" or not getattr(config, "moe_router_pre_softmax", False),
        routing_map=True,
    )


class _GatingWrapper:
    """The router's ``gating`` with a callback on its logits; ``remove()`` restores it.

    ``gating`` is a plain method, not a module: no hook can see its output. The wrapper
    is an attribute of this one router instance, never of the class."""

    def __init__(self, router: nn.Module, on_logits: Callable[[Tensor], None]) -> None:
        self.router = router
        self.inner = router.gating  # the bound method, or an earlier wrapper
        self.on_logits = on_logits
        router.gating = self  # type: ignore[method-assign]

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        logits = self.inner(*args, **kwargs)
        self.on_logits(logits)
        return logits

    def remove(self) -> None:
        if self.router.__dict__.get("gating") is self:
            if getattr(self.inner, "__self__", None) is self.router:
                del self.router.gating  # back to the class's method
            else:
                self.router.gating = self.inner  # type: ignore[method-assign]


def _wrap_gating(router: nn.Module, on_logits: Callable[[Tensor], None]) -> RemovableHandle:
    return _GatingWrapper(router, on_logits)  # type: ignore[return-value]


def _make_core_attention_hook(
    callback: QKCallback,
) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
    def core_attention_hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        # A packed batch ([t, heads, d] with cu_seqlens) is not a [b, s] softmax.
        if kwargs.get("packed_seq_params") is not None:
            return
        query = args[0] if args else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs["key"]
        # [s, b, heads, d] -> [b, heads, s, d]: views, no copy.
        callback(query.detach().permute(1, 2, 0, 3), key.detach().permute(1, 2, 0, 3))

    return core_attention_hook
