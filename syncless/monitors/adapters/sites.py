"""What an adapter finds in a model: per-layer sites, and the hooks that read them.

A *site* names the module to hook and the static facts a monitor needs (head counts,
expert counts, softmax scale), all read at registration from module attributes or the
model config, never from a tensor. Its ``attach_*`` methods install the forward hooks
and hand the monitor the tensors it measures; the hooks only reshape and forward
tensors the model already computed (or, where the model exposes no module boundary,
recompute a cheap elementwise step), so they never sync.

Callbacks receive *detached* tensors: a monitor computes statistics, not gradients,
and a detached input keeps its work out of the autograd graph. They may share storage
with the model's tensors, so a callback must not modify them in place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch build without distributed: no DTensor can exist

    class DTensor:  # type: ignore[no-redef]
        pass


QKCallback = Callable[[Tensor, Tensor], None]
TensorCallback = Callable[[Tensor], None]
# (router logits [T, n_experts], the router's own routing map [T, n_experts] bool)
RoutingCallback = Callable[[Tensor, Tensor], None]
RopeFn = Callable[..., tuple[Tensor, Tensor]]


class Rotary:
    """The rotary embedding a site has not applied yet: ``cos``/``sin`` ``[B or 1, L,
    D]`` in the rotate-half convention (``x * cos + rotate_half(x) * sin``), and the
    model's own function, ``apply(q, k, cos, sin) -> (q, k)``, for consumers that want
    the rotated tensors."""

    __slots__ = ("apply", "cos", "sin")

    def __init__(self, cos: Tensor, sin: Tensor, apply: RopeFn) -> None:
        self.cos, self.sin, self.apply = cos, sin, apply

    def rotated(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return self.apply(q, k, self.cos, self.sin)


RotaryQKCallback = Callable[[Tensor, Tensor, "Rotary | None"], None]


@dataclass
class AttentionSite:
    """One attention module and the static shape of its softmax(QK^T).

    ``n_heads`` / ``n_kv_heads`` are the query and key/value heads this rank's q and k
    carry (``n_kv_heads < n_heads`` under grouped-query attention), ``scale`` multiplies
    QK^T before the softmax, ``causal`` says whether a causal mask is applied
    (``sliding_window``, when set, further limits each query to the last
    ``sliding_window`` keys).

    Under tensor parallelism a rank holds a contiguous slice of the heads: query heads
    ``head_offset .. head_offset + n_heads - 1`` of ``total_heads``. Monitors record
    per-head statistics under the global head index, so the flush's cross-rank reduce
    assembles every head. ``total_heads=None`` means this rank holds them all.

    Adapters subclass this and implement :meth:`attach_qk` for their model family.
    """

    layer: int
    module: nn.Module
    n_heads: int
    n_kv_heads: int
    head_dim: int
    scale: float
    causal: bool
    sliding_window: int | None = None
    head_offset: int = 0
    total_heads: int | None = None

    @property
    def global_heads(self) -> int:
        """The query heads of the whole layer, across tensor-parallel ranks."""
        return self.n_heads if self.total_heads is None else self.total_heads

    def attach_qk(self, callback: QKCallback) -> list[RemovableHandle]:
        """Call ``callback(q, k)`` once per forward of :attr:`module`.

        ``q`` is ``[B, n_heads, L, head_dim]`` and ``k`` is ``[B, n_kv_heads, S,
        head_dim]`` (``S == L`` for self-attention), post positional encoding, exactly
        as they enter softmax(q k^T * scale); kv heads are not repeated. The hooks are
        sync-free. Remove the returned handles to detach them.
        """
        raise NotImplementedError(
            f"{type(self).__name__} does not implement attach_qk(); an adapter's "
            "AttentionSite subclass must (see docs/adapters.md)"
        )

    def attach_qk_rotary(self, callback: RotaryQKCallback) -> list[RemovableHandle]:
        """Call ``callback(q, k, rotary)`` once per forward of :attr:`module`.

        Like :meth:`attach_qk`, except that a site whose model rotates q and k outside
        any module boundary may hand them over *before* the rotation, with a
        :class:`Rotary` that says how (``rotary`` is ``None`` when q and k are already
        rotated). A kernel can then apply the rotation as it reads q and k, instead of
        the adapter re-running the model's rotation in separate passes. Default: the
        rotated tensors of :meth:`attach_qk` and ``None``.
        """
        return self.attach_qk(_without_rotary(callback))


@dataclass
class RouterSite:
    """One MoE router: ``n_experts`` experts, ``top_k`` chosen per token.

    ``score`` is how router logits become probabilities (``"softmax"`` or
    ``"sigmoid"``); ``normalize_topk`` says whether the chosen top-k weights are
    renormalised to sum to one.

    The logits are read from the output of ``logits_module`` (default: ``module``),
    element ``logits_index`` of it when that output is a tuple (``None``: the output
    is the logits tensor itself). An adapter whose router exposes its logits some
    other way overrides :meth:`attach_logits`.

    ``routing_map=True``: the site also hands over the router's own choice of experts
    (:meth:`attach_routing`), and monitors count tokens per expert from it rather than
    from a top-k of the logits. Routers whose choice is not the top-k of their scores
    (an expert bias, group-limited routing, capacity dropping) need it.
    """

    layer: int
    module: nn.Module
    n_experts: int
    top_k: int
    score: str
    normalize_topk: bool
    logits_module: nn.Module | None = field(default=None, repr=False)
    logits_index: int | None = None
    routing_map: bool = False

    def attach_routing(self, callback: RoutingCallback) -> list[RemovableHandle]:
        """Call ``callback(logits, routing_map)`` once per forward: the logits as in
        :meth:`attach_logits` and the experts the router chose, ``[T, n_experts]``
        bool. Only sites with ``routing_map=True`` implement it."""
        raise NotImplementedError(
            f"{type(self).__name__} (layer {self.layer}) does not hand over its routing "
            "map (routing_map=False): use attach_logits()"
        )

    def attach_logits(self, callback: TensorCallback) -> list[RemovableHandle]:
        """Call ``callback(router_logits)`` once per forward, logits ``[T, n_experts]``.

        ``T`` is the number of tokens this rank routed (batch and sequence flattened).
        """
        target = self.logits_module if self.logits_module is not None else self.module
        return [target.register_forward_hook(_make_logits_hook(callback, self))]


@dataclass
class LayerSite:
    """One transformer block: its attention, its router (``None`` for dense layers)
    and its MLP or MoE module.

    ``output_replica``: this rank's block output is a copy of one that another rank
    measures too (tensor-parallel ranks other than the first, without sequence
    parallelism). Monitors of the output leave such a copy alone: a count summed over
    ranks would count it once per copy.
    """

    index: int
    block: nn.Module
    attention: AttentionSite | None
    router: RouterSite | None
    mlp: nn.Module | None
    output_replica: bool = False

    def parameters(self) -> list[nn.Parameter]:
        """This layer's parameters (every parameter of :attr:`block`), for norms."""
        return list(self.block.parameters())

    def attach_output(self, callback: TensorCallback) -> list[RemovableHandle]:
        """Call ``callback(hidden)`` with the block's output hidden state ``[..., d_model]``.

        Blocks that return a tuple (``(hidden, aux)``, older Hugging Face layers) give
        its first element. A DTensor output gives this rank's own elements, or no call
        where they are another rank's copy (:func:`own_elements`).
        """
        return [self.block.register_forward_hook(_make_output_hook(callback))]

    def attach_output_grad(self, callback: TensorCallback) -> list[RemovableHandle]:
        """Call ``callback(grad)`` with the gradient arriving at the block's output, in
        the backward: a tensor hook, registered on each forward's output that requires
        grad (an evaluation forward registers none).

        Under activation checkpointing it counts once either way. Non-reentrant: the
        forward's output is in the graph the backward walks, and a recompute's copies
        are only read for saved tensors (their hooks never fire). Reentrant: the
        forward runs without grad (no hook), the recompute with it (one hook). Megatron's
        full recompute enables grad inside its no-grad forward (bias-dropout-add), so
        that forward's outputs get a hook too; the backward never walks their graph,
        and only the recompute's hook fires.

        The gradient of a DTensor output is a DTensor: the callback takes this rank's
        part itself (:func:`own_elements`), inside its error handling."""
        return [self.block.register_forward_hook(_make_output_grad_hook(callback))]


@dataclass
class ModelMap:
    """The layers an adapter found, in model order, and the model width.

    ``param_layout``: how a parameter is laid out across ranks, for models whose
    parameters are plain tensors that differ across ranks (Megatron's tensor- and
    expert-parallel weights): ``param_layout(p)`` returns a
    ``syncless.monitors.norms_sharding.Layout``, or ``None`` to let the norms monitor
    decide as for any other model.
    """

    adapter: str
    layers: list[LayerSite]
    d_model: int
    param_layout: Callable[[Tensor], Any] | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[LayerSite]:
        return iter(self.layers)

    @property
    def attention(self) -> list[AttentionSite]:
        """The attention sites of every layer that has one."""
        return [layer.attention for layer in self.layers if layer.attention is not None]

    @property
    def routers(self) -> list[RouterSite]:
        """The router sites of the MoE layers."""
        return [layer.router for layer in self.layers if layer.router is not None]


def _without_rotary(callback: RotaryQKCallback) -> QKCallback:
    def qk(q: Tensor, k: Tensor) -> None:
        callback(q, k, None)

    return qk


def _make_logits_hook(
    callback: TensorCallback, site: RouterSite
) -> Callable[[nn.Module, tuple[Tensor, ...], object], None]:
    index = site.logits_index
    n_experts = site.n_experts

    def logits_hook(module: nn.Module, args: tuple[Tensor, ...], output: object) -> None:
        logits = output if index is None else output[index]  # type: ignore[index]
        # reshape, not a data-dependent view: the expert count is fixed at registration.
        callback(logits.detach().reshape(-1, n_experts))

    return logits_hook


def own_elements(t: Tensor) -> Tensor | None:
    """The elements of ``t`` this rank measures: ``t`` itself unless it is a DTensor.

    A DTensor (block outputs under torchtitan's ``full_dtensor`` backend, activations
    under tensor parallelism on DTensors) gives its local shard (``to_local``: a view;
    a statistic of the DTensor itself would be a collective in the hook), or ``None``
    where that shard is a copy of another rank's (``Replicate`` on a mesh dimension
    where this rank is not the first): the flush's reduce then counts every element
    once. A partial sum (a ``Partial`` placement) comes back as the DTensor: no rank
    holds its elements, and the monitor's hook reports that it cannot read it. The
    placements are Python metadata fixed by the parallelisation: no sync.
    """
    if not isinstance(t, DTensor):
        return t
    mesh = t.device_mesh
    for dim, placement in enumerate(t.placements):
        if placement.is_partial():
            return t
        if placement.is_replicate() and mesh.get_local_rank(dim) != 0:
            return None
    return t.to_local()


def _make_output_hook(
    callback: TensorCallback,
) -> Callable[[nn.Module, tuple[Tensor, ...], object], None]:
    def output_hook(module: nn.Module, args: tuple[Tensor, ...], output: object) -> None:
        # The output's Python type, not a tensor value: a structural branch.
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        own = own_elements(hidden.detach())  # type: ignore[union-attr]
        if own is not None:
            callback(own)

    return output_hook


def _make_output_grad_hook(callback: TensorCallback):
    def output_hook(module: nn.Module, args: tuple[Tensor, ...], output: object) -> None:
        # The output's Python type and requires_grad, not a tensor value: structural.
        hidden = output[0] if isinstance(output, (tuple, list)) else output
        if isinstance(hidden, Tensor) and hidden.requires_grad:
            hidden.register_hook(callback)  # the callback returns None: g is unchanged

    return output_hook
