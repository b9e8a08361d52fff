"""Adapter for Hugging Face decoder-only transformers (Llama family and MoE relatives).

Covers ``LlamaForCausalLM`` / ``LlamaModel``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``, ``MixtralForCausalLM``, ``Qwen2MoeForCausalLM`` and models built
the same way (Qwen3, Qwen3-MoE, OLMo-2, ...). Recognised by structure, never by class
name, and without importing ``transformers`` (the model's own modules are already
loaded): decoder blocks at ``model.model.layers`` / ``model.layers`` (or under a
``language_model``), each with ``self_attn.q_proj`` / ``self_attn.k_proj``, and a
config with ``num_attention_heads`` and ``hidden_size``.

q/k capture (the model has no module boundary after RoPE): the attention computes
``q = q_proj(x).view(B, L, -1, D).transpose(1, 2)`` (likewise k, with ``q_norm`` /
``k_norm`` in between where the model has them), then ``q, k =
apply_rotary_pos_emb(q, k, cos, sin)`` with ``(cos, sin) = position_embeddings``
passed in by the decoder layer, then softmax(q k^T * scaling). The adapter hooks:

- a forward-pre-hook (with kwargs) on ``self_attn``: records the input's leading shape
  and ``position_embeddings``;
- forward hooks on ``q_norm``/``k_norm`` (else ``q_proj``/``k_proj``): keep their
  outputs;
- a forward hook on ``self_attn``: reshapes them exactly as the model does and, for
  ``attach_qk``, applies the model's own ``apply_rotary_pos_emb`` (looked up in the
  attention class's module) to the detached tensors, then calls the callback.

The projections are not recomputed. ``attach_qk`` recomputes the rotation once more per
attention forward: a few elementwise passes over q and k (about 6 reads/writes of
``B*L*(H+H_kv)*D`` elements, in float32 under autocast since HF's cos/sin are float32),
no autograd graph; the same function on the same inputs gives bitwise what entered the
softmax. ``attach_qk_rotary`` skips it when the model's function is the rotate-half
rotation (checked once, at registration, on random inputs against the formula): it
hands the unrotated q and k with a :class:`Rotary`, and the attention monitor's kernel
rotates them as it reads them. On the H200 the recompute, its float32 copies and their
casts cost the Llama of issue #19 more than the statistics kernel itself (+8.8% of the
step with the kernel on bf16 inputs). With a KV cache (generation), k is the new
tokens' keys only, not the cached ones.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from syncless.errors import UsageError
from syncless.monitors.adapters._modules import get_path, layer_list, unwrap
from syncless.monitors.adapters.hf_qk import (
    QKState,
    is_rotate_half,
    make_attn_post_hook,
    make_attn_pre_hook,
    make_proj_hook,
    make_rotary_post_hook,
)
from syncless.monitors.adapters.sites import (
    AttentionSite,
    LayerSite,
    ModelMap,
    QKCallback,
    RopeFn,
    RotaryQKCallback,
    RouterSite,
)

# Where decoder blocks live: CausalLM (model.model.layers), bare model (layers),
# multimodal wrappers (language_model).
_LAYER_PATHS = (
    "model.layers",
    "layers",
    "model.language_model.layers",
    "language_model.model.layers",
    "language_model.layers",
)
_MOE_ATTRS = ("mlp", "block_sparse_moe")  # block_sparse_moe: Mixtral before transformers 4.5x
_ROPE_NAME = "apply_rotary_pos_emb"


@dataclass
class HFAttentionSite(AttentionSite):
    """Hugging Face attention: post-RoPE q/k rebuilt from the projections (see module doc)."""

    rope: RopeFn | None = field(default=None, repr=False)
    rope_problem: str = field(default="", repr=False)
    # The model's rotation is rotate-half (checked at registration): q/k may be handed
    # over unrotated (attach_qk_rotary).
    rotate_half: bool = field(default=False, repr=False)

    def attach_qk(self, callback: QKCallback) -> list[RemovableHandle]:
        state = QKState()
        post = make_attn_post_hook(state, self._rope(), self.head_dim, callback)
        return self._hooks(state, post)

    def attach_qk_rotary(self, callback: RotaryQKCallback) -> list[RemovableHandle]:
        if not self.rotate_half:
            return super().attach_qk_rotary(callback)
        state = QKState()
        post = make_rotary_post_hook(state, self._rope(), self.head_dim, callback)
        return self._hooks(state, post)

    def _rope(self) -> RopeFn:
        if self.rope is None:
            raise UsageError(
                f"attach_qk() on layer {self.layer} ({type(self.module).__name__}): "
                f"{self.rope_problem} Register an adapter for this model "
                "(see docs/adapters.md)."
            )
        return self.rope

    def _hooks(self, state: QKState, post_hook: Callable[..., None]) -> list[RemovableHandle]:
        attn = self.module
        q_src = _submodule(attn, "q_norm") or attn.q_proj
        k_src = _submodule(attn, "k_norm") or attn.k_proj
        return [
            attn.register_forward_pre_hook(make_attn_pre_hook(state), with_kwargs=True),
            q_src.register_forward_hook(make_proj_hook(state, "q")),
            k_src.register_forward_hook(make_proj_hook(state, "k")),
            attn.register_forward_hook(post_hook),
        ]


class HFAdapter:
    """Maps Hugging Face Llama / Mistral / Qwen2 / Mixtral / Qwen2-MoE style models."""

    name = "huggingface"
    looked_for = (
        f"decoder blocks at one of {', '.join(_LAYER_PATHS)} (ModuleList), each with "
        ".self_attn having q_proj and k_proj, and a `config` with num_attention_heads "
        "and hidden_size; MoE blocks: .mlp (or .block_sparse_moe) with .gate and .experts"
    )

    def matches(self, model: nn.Module) -> bool:
        blocks = _blocks(model)
        config = _config(model)
        return (
            bool(blocks)
            and config is not None
            and all(_attention_of(b) is not None for b in blocks)  # type: ignore[union-attr]
        )

    def map(self, model: nn.Module, first_layer: int = 0) -> ModelMap:
        blocks = _blocks(model) or []
        config = _config(model)
        layers = [_map_block(b, first_layer + i, config) for i, b in enumerate(blocks)]
        return ModelMap(adapter=self.name, layers=layers, d_model=int(config.hidden_size))


def _blocks(model: nn.Module) -> list[nn.Module] | None:
    for path in _LAYER_PATHS:
        blocks = layer_list(get_path(model, path))
        if blocks:
            return blocks
    return None


def _config(model: nn.Module) -> Any | None:
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", None)
    if callable(text):
        config = text()  # multimodal configs nest the decoder's config
    if hasattr(config, "num_attention_heads") and hasattr(config, "hidden_size"):
        return config
    return None


def _attention_of(block: nn.Module) -> nn.Module | None:
    attn = getattr(unwrap(block), "self_attn", None)
    if isinstance(attn, nn.Module) and all(
        isinstance(getattr(attn, p, None), nn.Module) for p in ("q_proj", "k_proj")
    ):
        return attn
    return None


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    sub = getattr(module, name, None)
    return sub if isinstance(sub, nn.Module) else None


def _map_block(block: nn.Module, index: int, model_config: Any) -> LayerSite:
    inner = unwrap(block)
    attn = _attention_of(inner)
    assert attn is not None  # matches() checked every block
    attn_config = getattr(attn, "config", None)
    config = attn_config if attn_config is not None else model_config
    n_heads = int(config.num_attention_heads)
    n_kv = int(getattr(config, "num_key_value_heads", None) or n_heads)
    head_dim = int(
        getattr(attn, "head_dim", None)
        or getattr(config, "head_dim", None)
        or config.hidden_size // n_heads
    )
    rope, problem = _rope_function(attn)
    attention = HFAttentionSite(
        layer=index,
        module=attn,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        scale=float(getattr(attn, "scaling", head_dim**-0.5)),
        causal=bool(getattr(attn, "is_causal", True)),
        sliding_window=_sliding_window(attn, config, index),
        rope=rope,
        rope_problem=problem,
        rotate_half=rope is not None and is_rotate_half(rope),
    )
    mlp = next((m for a in _MOE_ATTRS if isinstance(m := getattr(inner, a, None), nn.Module)), None)
    return LayerSite(
        index=index,
        block=block,
        attention=attention,
        router=_router(mlp, config, index),
        mlp=mlp,
    )


def _rope_function(attn: nn.Module) -> tuple[RopeFn | None, str]:
    """The ``apply_rotary_pos_emb`` the attention's forward calls, or why there is none."""
    cls = type(attn)
    fn = getattr(sys.modules.get(cls.__module__), _ROPE_NAME, None)
    if not callable(fn):
        return None, (
            f"its module {cls.__module__} defines no `{_ROPE_NAME}`, so the adapter cannot "
            "apply the model's rotary embedding to the captured q/k."
        )
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        source = None  # no source (frozen, compiled): trust the module-level function
    if source is not None and _ROPE_NAME not in source:
        return None, (
            f"{cls.__name__}.forward does not call `{_ROPE_NAME}`, so the q/k entering its "
            "softmax are not the rotated projections this adapter rebuilds."
        )
    return fn, ""


def _sliding_window(attn: nn.Module, config: Any, index: int) -> int | None:
    # Qwen2 sets it per layer on the module; Qwen2-MoE only on sliding layers; Mistral and
    # Mixtral read config.sliding_window for every layer.
    if hasattr(attn, "sliding_window"):
        window = attn.sliding_window
    else:
        types = getattr(config, "layer_types", None)
        layer_idx = getattr(attn, "layer_idx", index)
        if types is not None and layer_idx < len(types):
            window = config.sliding_window if types[layer_idx] == "sliding_attention" else None
        else:
            window = getattr(config, "sliding_window", None)
    return int(window) if window else None  # 0 means "none" in some configs


def _router(mlp: nn.Module | None, config: Any, index: int) -> RouterSite | None:
    if mlp is None or not hasattr(mlp, "experts"):
        return None  # a dense MLP (Llama, or Qwen2-MoE's dense layers)
    gate = _submodule(mlp, "gate") or _submodule(mlp, "router")
    if gate is None:
        return None
    weight = getattr(gate, "weight", None)
    n_experts = (
        getattr(gate, "num_experts", None)
        or getattr(config, "num_local_experts", None)
        or getattr(config, "num_experts", None)
        or (weight.shape[0] if weight is not None else None)
    )
    top_k = (
        getattr(gate, "top_k", None)
        or getattr(mlp, "top_k", None)
        or getattr(config, "num_experts_per_tok", None)
    )
    if not n_experts or not top_k:
        raise UsageError(
            f"layer {index}: {type(mlp).__name__} has a router ({type(gate).__name__}) but "
            "the adapter found no expert count (gate.num_experts, config.num_local_experts, "
            "config.num_experts) or top-k (gate.top_k, config.num_experts_per_tok)"
        )
    normalize = next(
        (
            v
            for v in (
                getattr(gate, "norm_topk_prob", None),
                getattr(mlp, "norm_topk_prob", None),
                getattr(config, "norm_topk_prob", None),
            )
            if v is not None
        ),
        True,  # Mixtral always renormalises and has no flag
    )
    return RouterSite(
        layer=index,
        module=gate,
        n_experts=int(n_experts),
        top_k=int(top_k),
        score=str(getattr(config, "scoring_func", None) or "softmax"),
        normalize_topk=bool(normalize),
        # transformers >= 5 routers return (logits, weights, indices); a plain Linear gate
        # (older versions) returns the logits.
        logits_index=None if isinstance(gate, nn.Linear) else 0,
    )
