"""Adapter for ``torch.nn.MultiheadAttention`` (a model that is, or contains, some).

Every ``nn.MultiheadAttention`` in the model is one layer, in module order, except the
cross-attention (``multihead_attn``) of ``nn.TransformerDecoderLayer``, whose keys come
from another sequence. A layer's block is the nearest enclosing element of a
ModuleList / Sequential (``encoder.layers[i]``), or the attention module itself when
there is none or several attentions share it. ``mlp`` is the block's ``mlp`` / ``ffn``
/ ``feed_forward`` submodule when it has one (``nn.TransformerEncoderLayer`` keeps its
feed-forward as loose ``linear1``/``linear2``, so it has none); there is no router.

q/k capture: ``F.multi_head_attention_forward`` projects q/k inside one function, with
no submodule to hook, so a forward-pre-hook recomputes them from the inputs:
``q = query @ W_q^T + b_q`` and ``k = key @ W_k^T + b_k`` with the ``in_proj_weight``
slices (or ``q_proj_weight``/``k_proj_weight``), then appends ``bias_k`` and the zero
key of ``add_zero_attn`` as the module does. Cost: two extra GEMMs per forward, ``2 *
N * E^2`` multiply-adds for ``N`` tokens of width ``E``, i.e. +50% of the module's own
projection work (no autograd graph: inputs are detached). The result equals the
module's q/k up to GEMM rounding (the module may project q, k, v in one packed GEMM).
There is no positional encoding to apply.

``causal`` cannot be read from the module: it is a per-call argument (``is_causal``,
or an ``attn_mask``). The site says ``causal=False`` unless the adapter is registered
with ``MultiheadAttentionAdapter(causal=True)`` for a model known to be causal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.hooks import RemovableHandle

from syncless.monitors.adapters.sites import AttentionSite, LayerSite, ModelMap, QKCallback

_MLP_ATTRS = ("mlp", "ffn", "feed_forward")


@dataclass
class MHAAttentionSite(AttentionSite):
    """``nn.MultiheadAttention``: q/k recomputed from the inputs in a forward-pre-hook."""

    def attach_qk(self, callback: QKCallback) -> list[RemovableHandle]:
        mha = self.module
        assert isinstance(mha, nn.MultiheadAttention)
        return [mha.register_forward_pre_hook(_make_mha_qk_hook(mha, callback), with_kwargs=True)]


class MultiheadAttentionAdapter:
    """Maps models built from ``torch.nn.MultiheadAttention``.

    ``causal`` is what the sites report (the module cannot tell, see the module doc).
    """

    name = "torch-mha"
    looked_for = (
        "torch.nn.MultiheadAttention modules (the model itself or any submodule; "
        "the cross-attention of nn.TransformerDecoderLayer is skipped)"
    )

    def __init__(self, causal: bool = False) -> None:
        self.causal = causal

    def matches(self, model: nn.Module) -> bool:
        return any(isinstance(m, nn.MultiheadAttention) for m in model.modules())

    def map(self, model: nn.Module, first_layer: int = 0) -> ModelMap:
        found = _self_attentions(model)
        blocks = [_block_of(model, name) for name, _ in found]
        layers = []
        for i, ((_, mha), block) in enumerate(zip(found, blocks, strict=True)):
            if block is None or blocks.count(block) > 1:
                block = mha  # no enclosing layer, or one shared with another attention
            index = first_layer + i
            site = MHAAttentionSite(
                layer=index,
                module=mha,
                n_heads=mha.num_heads,
                n_kv_heads=mha.num_heads,
                head_dim=mha.head_dim,
                scale=mha.head_dim**-0.5,  # F.multi_head_attention_forward's fixed scale
                causal=self.causal,
            )
            mlp = next(
                (m for a in _MLP_ATTRS if isinstance(m := getattr(block, a, None), nn.Module)),
                None,
            )
            layers.append(LayerSite(index=index, block=block, attention=site, router=None, mlp=mlp))
        return ModelMap(adapter=self.name, layers=layers, d_model=found[0][1].embed_dim)


def _self_attentions(model: nn.Module) -> list[tuple[str, nn.MultiheadAttention]]:
    cross = {
        id(m.multihead_attn) for m in model.modules() if isinstance(m, nn.TransformerDecoderLayer)
    }
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.MultiheadAttention) and id(m) not in cross
    ]


def _block_of(model: nn.Module, name: str) -> nn.Module | None:
    """The deepest ancestor of ``name`` (or itself) that is an element of a list container."""
    parts = name.split(".") if name else []
    for depth in range(len(parts), 0, -1):
        parent = model.get_submodule(".".join(parts[: depth - 1]))
        if isinstance(parent, (nn.ModuleList, nn.Sequential)):
            return model.get_submodule(".".join(parts[:depth]))
    return None


def _make_mha_qk_hook(
    mha: nn.MultiheadAttention, callback: QKCallback
) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
    # Fixed by the module's construction: decided here, not per call.
    e, n_heads, head_dim = mha.embed_dim, mha.num_heads, mha.head_dim
    batch_first, packed = mha.batch_first, mha._qkv_same_embed_dim
    has_bias, has_bias_k, zero_attn = (
        mha.in_proj_bias is not None,
        mha.bias_k is not None,
        mha.add_zero_attn,
    )

    def mha_qk_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        query = args[0] if len(args) > 0 else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs["key"]
        # Parameters are read per call: wrappers (FSDP) may swap the Parameter objects.
        if packed:
            w_q, w_k = mha.in_proj_weight[:e], mha.in_proj_weight[e : 2 * e]
        else:
            w_q, w_k = mha.q_proj_weight, mha.k_proj_weight
        b_q = mha.in_proj_bias[:e].detach() if has_bias else None
        b_k = mha.in_proj_bias[e : 2 * e].detach() if has_bias else None
        q = F.linear(query.detach(), w_q.detach(), b_q)
        k = F.linear(key.detach(), w_k.detach(), b_k)
        # To [B, S, E]. Unbatched ([L, E]) or not is a property of the call's shapes.
        if q.dim() == 2:
            q, k = q.unsqueeze(0), k.unsqueeze(0)
        elif not batch_first:
            q, k = q.transpose(0, 1), k.transpose(0, 1)
        b = q.shape[0]
        if has_bias_k:  # add_bias_kv: one learned key appended after the projection
            k = torch.cat([k, mha.bias_k.detach().view(1, 1, e).expand(b, 1, e)], dim=1)
        q = q.reshape(b, -1, n_heads, head_dim).transpose(1, 2)
        k = k.reshape(b, -1, n_heads, head_dim).transpose(1, 2)
        if zero_attn:  # add_zero_attn: then one all-zero key per head
            k = torch.cat([k, k.new_zeros(b, n_heads, 1, head_dim)], dim=2)
        callback(q, k)

    return mha_qk_hook
