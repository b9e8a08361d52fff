"""Adapter for the syncless demo model (``syncless.demo.model.MoETransformer``).

Recognised by structure, not by importing the demo (nothing in the library imports
``syncless.demo``): ``model.layers[i]`` blocks with an ``attn`` module (``q_proj``,
``k_proj``, a ``rotary`` submodule, ``n_heads``, ``head_dim``) and, for MoE blocks, a
``moe.router`` with a ``gate`` Linear and ``top_k``.

q/k capture: the attention computes ``q = rotary(heads(q_proj(x)))`` and then
``k = rotary(heads(k_proj(x)))`` and hands exactly those two tensors to SDPA. A
forward-pre-hook on the attention module empties the slot list, and a forward hook on
``rotary`` keeps its first output (q) and passes the pair to the callback at its second
(k). Nothing is recomputed, and the callback sees the very tensors SDPA receives
(detached). A hook on the attention's output as well, to hand the pair over there, was
one more hook call per layer (the H200's host spends 11-18 us on each; see
``syncless.monitors.output_read``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from syncless.monitors.adapters._modules import get_path, layer_list, unwrap
from syncless.monitors.adapters.sites import (
    AttentionSite,
    LayerSite,
    ModelMap,
    QKCallback,
    RouterSite,
)

_ATTN_ATTRS = ("q_proj", "k_proj", "rotary", "n_heads", "head_dim")


@dataclass
class DemoAttentionSite(AttentionSite):
    """Demo attention: q/k are the two outputs of ``module.rotary`` per forward."""

    def attach_qk(self, callback: QKCallback) -> list[RemovableHandle]:
        captured: list[Tensor | None] = []
        rotary: nn.Module = self.module.rotary  # type: ignore[assignment]
        return [
            self.module.register_forward_pre_hook(_make_reset_hook(captured)),
            rotary.register_forward_hook(_make_qk_hook(captured, callback)),
        ]


class DemoAdapter:
    """Maps ``syncless.demo.model.MoETransformer`` (and models built like it)."""

    name = "syncless-demo"
    looked_for = (
        "model.layers[i] (ModuleList) blocks with .attn having "
        f"{', '.join(_ATTN_ATTRS)}; MoE blocks with .moe.router.gate (Linear) and "
        ".moe.router.top_k"
    )

    def matches(self, model: nn.Module) -> bool:
        blocks = layer_list(get_path(model, "layers"))
        return bool(blocks) and all(_is_demo_block(b) for b in blocks)  # type: ignore[union-attr]

    def map(self, model: nn.Module, first_layer: int = 0) -> ModelMap:
        blocks = layer_list(get_path(model, "layers")) or []
        layers = [_map_block(block, first_layer + i) for i, block in enumerate(blocks)]
        d_model = unwrap(blocks[0]).attn.q_proj.in_features  # type: ignore[union-attr]
        return ModelMap(adapter=self.name, layers=layers, d_model=int(d_model))


def _is_demo_block(block: nn.Module) -> bool:
    attn = getattr(unwrap(block), "attn", None)
    return isinstance(attn, nn.Module) and all(hasattr(attn, a) for a in _ATTN_ATTRS)


def _map_block(block: nn.Module, index: int) -> LayerSite:
    inner = unwrap(block)
    attn: nn.Module = inner.attn  # type: ignore[assignment]
    n_heads, head_dim = int(attn.n_heads), int(attn.head_dim)  # type: ignore[arg-type]
    attention = DemoAttentionSite(
        layer=index,
        module=attn,
        n_heads=n_heads,
        n_kv_heads=n_heads,  # the demo has no grouped-query attention
        head_dim=head_dim,
        scale=head_dim**-0.5,  # SDPA's default: the demo passes no scale
        causal=True,
    )
    moe = getattr(inner, "moe", None)
    router_module = getattr(moe, "router", None)
    gate = getattr(router_module, "gate", None)
    router = None
    if isinstance(router_module, nn.Module) and isinstance(gate, nn.Linear):
        router = RouterSite(
            layer=index,
            module=router_module,
            n_experts=gate.out_features,
            top_k=int(router_module.top_k),  # type: ignore[arg-type]
            score="softmax",
            normalize_topk=True,  # Router divides the top-k weights by their sum
            logits_module=gate,  # Router.forward returns probabilities, gate the logits
        )
    mlp = moe if isinstance(moe, nn.Module) else getattr(inner, "mlp", None)
    return LayerSite(index=index, block=block, attention=attention, router=router, mlp=mlp)


def _make_reset_hook(
    captured: list[Tensor | None],
) -> Callable[[nn.Module, tuple[Tensor, ...]], None]:
    def reset_hook(module: nn.Module, args: tuple[Tensor, ...]) -> None:
        captured.clear()

    return reset_hook


def _make_qk_hook(
    captured: list[Tensor | None], callback: QKCallback
) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], None]:
    def qk_hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        # A count of Python objects, fixed by the model's code: not a tensor value.
        if not captured:
            captured.append(output.detach())  # q; k comes next
            return
        if len(captured) != 1:
            raise RuntimeError(
                f"syncless demo adapter: the attention's rotary module ran {len(captured) + 1}"
                " times in one forward, expected 2 (q then k); the model's Attention.forward "
                "changed, update syncless/monitors/adapters/demo.py"
            )
        q = captured[0]
        # Two entries: a third call in this forward is an error (above); no reference
        # to q is kept past its forward.
        captured[0] = None
        captured.append(None)
        callback(q, output.detach())

    return qk_hook
