"""The Hugging Face adapter's q/k capture (``syncless.monitors.adapters.hf``).

The attention has no module boundary after its rotary embedding: hooks on the attention
(its input's shape and ``position_embeddings``), on ``q_norm``/``k_norm`` or
``q_proj``/``k_proj`` (their outputs) and after the attention hand one forward's pieces
to each other through a ``QKState``; the post hook either re-applies the model's own
rotation (``attach_qk``) or hands q/k unrotated with a ``Rotary`` when the model's
rotation is rotate-half (``attach_qk_rotary``, ``is_rotate_half``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from syncless.monitors.adapters.sites import QKCallback, RopeFn, Rotary, RotaryQKCallback


@functools.cache  # every layer of a model shares one function: tried once
def is_rotate_half(rope: RopeFn) -> bool:
    """Whether ``rope(q, k, cos, sin)`` is ``x * cos + rotate_half(x) * sin`` with cos/sin
    ``[B, L, D]`` broadcast over heads: tried on random float64 inputs (cold path)."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, h, 3, 8, generator=g, dtype=torch.float64) for h in (2, 1))
    cos, sin = (torch.randn(1, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))

    def reference(x: Tensor) -> Tensor:
        turned = torch.cat((-x[..., 4:], x[..., :4]), dim=-1)
        return x * cos[:, None] + turned * sin[:, None]

    try:
        q_out, k_out = rope(q, k, cos, sin)
    except Exception:  # another signature or convention: the recompute path stays
        return False
    return bool(torch.allclose(q_out, reference(q)) and torch.allclose(k_out, reference(k)))


class QKState:
    """What one attention forward's hooks hand to each other (plain attributes)."""

    __slots__ = ("cos", "k", "q", "shape", "sin")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.shape: tuple[int, ...] = ()
        self.cos: Tensor | None = None
        self.sin: Tensor | None = None
        self.q: Tensor | None = None
        self.k: Tensor | None = None


def make_attn_pre_hook(
    state: QKState,
) -> Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], None]:
    def attn_pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        state.clear()
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        state.shape = tuple(hidden.shape[:-1])
        embeddings = kwargs.get("position_embeddings")
        if embeddings is None and len(args) > 1:
            embeddings = args[1]
        if embeddings is None:
            raise RuntimeError(
                f"syncless huggingface adapter: {type(module).__name__} was called without "
                "position_embeddings=(cos, sin); this transformers version computes RoPE "
                "inside the attention, which the adapter does not support (transformers "
                ">= 4.48 passes position_embeddings)"
            )
        state.cos, state.sin = embeddings

    return attn_pre_hook


def make_proj_hook(
    state: QKState, slot: str
) -> Callable[[nn.Module, tuple[Tensor, ...], Tensor], None]:
    def proj_hook(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        setattr(state, slot, output.detach())

    return proj_hook


def _take_unrotated(state: QKState, head_dim: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """This forward's q, k (unrotated), cos and sin; the state lets go of them."""
    # The model's own reshape: view(*input_shape, -1, head_dim).transpose(1, 2).
    q = state.q.view(*state.shape, -1, head_dim).transpose(1, 2)  # type: ignore[union-attr]
    k = state.k.view(*state.shape, -1, head_dim).transpose(1, 2)  # type: ignore[union-attr]
    cos, sin = state.cos.detach(), state.sin.detach()  # type: ignore[union-attr]
    state.clear()  # drop the references until the next forward
    return q, k, cos, sin


def make_attn_post_hook(
    state: QKState, rope: RopeFn, head_dim: int, callback: QKCallback
) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
    def attn_post_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        q, k, cos, sin = _take_unrotated(state, head_dim)
        callback(*rope(q, k, cos, sin))

    return attn_post_hook


def make_rotary_post_hook(
    state: QKState, rope: RopeFn, head_dim: int, callback: RotaryQKCallback
) -> Callable[[nn.Module, tuple[Any, ...], Any], None]:
    def attn_post_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        q, k, cos, sin = _take_unrotated(state, head_dim)
        # Shapes and strides only (host metadata): the kernels read cos/sin as [B or 1,
        # L, D] sharing one layout; anything else (partial rotary, another layout) gets
        # the model's own rotation here instead.
        if (
            cos.dim() == 3
            and cos.shape[1:] == (q.shape[2], head_dim)
            and cos.shape[0] in (1, q.shape[0])
            and sin.shape == cos.shape
            and sin.stride() == cos.stride()
            and k.shape[2] == q.shape[2]
        ):
            callback(q, k, Rotary(cos, sin, rope))
        else:
            q, k = rope(q, k, cos, sin)
            callback(q, k, None)

    return attn_post_hook
