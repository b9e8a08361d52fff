"""MoE router statistics of one forward in one pass over the logits ``[T, E]``.

Per block of ``BLOCK_T`` tokens: scores (softmax or sigmoid), the top-k choice by
``k`` masked argmaxes (ties go to the lower expert id), per-expert token counts, the
z-loss sum ``Σ logsumexp(x)^2`` and the top-k mass sum (chosen scores over all scores).
Partials ``[ceil(T / BLOCK_T), E + 2]``: counts, z-loss sum, mass sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from syncless.hot_path import hot_path

_BLOCK_T = 64


@triton.jit
def _router_block(
    x_ptr, pid, T, E, sxt, sxe,
    TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """(per-expert counts, z-loss sum, top-k mass sum) of token block ``pid``."""
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    t_ok = t < T
    e_ok = e < E
    x = tl.load(
        x_ptr + t[:, None].to(tl.int64) * sxt + e[None, :] * sxe,
        mask=t_ok[:, None] & e_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    x = tl.where(e_ok[None, :], x, float("-inf"))
    row_max = tl.max(x, axis=1)
    ex = tl.exp(x - row_max[:, None])
    z = tl.sum(ex, axis=1)
    lse = row_max + tl.log(z)
    if SOFTMAX:
        scores = ex / z[:, None]
        total = tl.full([BLOCK_T], 1.0, dtype=tl.float32)
    else:
        scores = tl.where(e_ok[None, :], tl.sigmoid(x), 0.0)
        total = tl.sum(scores, axis=1)
    # Scores are >= 0: -1 marks padding experts, -2 experts already chosen.
    work = tl.where(e_ok[None, :], scores, -1.0)
    chosen = tl.zeros([BLOCK_T], dtype=tl.float32)
    counts = tl.zeros([BLOCK_E], dtype=tl.float32)
    for _ in tl.static_range(TOP_K):
        best = tl.argmax(work, axis=1)
        hit = e[None, :] == best[:, None]
        chosen += tl.max(work, axis=1)
        counts += tl.sum((hit & t_ok[:, None]).to(tl.float32), axis=0)
        work = tl.where(hit, -2.0, work)
    zsum = tl.sum(tl.where(t_ok, lse * lse, 0.0), axis=0)
    msum = tl.sum(tl.where(t_ok, chosen / total, 0.0), axis=0)
    return counts, zsum, msum


@triton.jit(do_not_specialize=["T"])  # the token count varies with the batch
def _router_kernel(
    gate_ptr, x_ptr, out_ptr, T, E, sxt, sxe,
    TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
    GATED: tl.constexpr,
):  # fmt: skip
    # Off in this replay of a CUDA graph: return before reading (the fold of the same
    # gate drops the partials). Nested: GATED is a constexpr, the load exists only if on.
    if GATED:  # noqa: SIM102
        if tl.load(gate_ptr) == 0.0:
            return
    pid = tl.program_id(0)
    counts, zsum, msum = _router_block(x_ptr, pid, T, E, sxt, sxe, TOP_K, SOFTMAX, BLOCK_T, BLOCK_E)
    e = tl.arange(0, BLOCK_E)
    out_row = out_ptr + pid.to(tl.int64) * (E + 2)
    tl.store(out_row + e, counts, mask=e < E)
    tl.store(out_row + E, zsum)
    tl.store(out_row + E + 1, msum)


@triton.jit(do_not_specialize=["T"])
def _router_grouped_kernel(
    gate_ptr, x_ptr, offsets_ptr, out_ptr, T, E, sxt, sxe, OUT_STRIDE,
    TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, ALIGN: tl.constexpr,
    GATED: tl.constexpr,
):  # fmt: skip
    """Layer ``program_id(1)`` reads ``x_ptr + offsets[layer]`` and writes its ``E + 2``
    columns at ``layer * (E + 2)`` of ``out`` ``[P, L * (E + 2)]``."""
    # Off in this replay of a CUDA graph: return before reading (the fold of the same
    # gate drops the partials). Nested: GATED is a constexpr, the load exists only if on.
    if GATED:  # noqa: SIM102
        if tl.load(gate_ptr) == 0.0:
            return
    pid = tl.program_id(0)
    layer = tl.program_id(1)
    base = x_ptr + tl.multiple_of(tl.load(offsets_ptr + layer), ALIGN)  # see attention
    counts, zsum, msum = _router_block(base, pid, T, E, sxt, sxe, TOP_K, SOFTMAX, BLOCK_T, BLOCK_E)
    e = tl.arange(0, BLOCK_E)
    out_row = out_ptr + pid.to(tl.int64) * OUT_STRIDE + layer.to(tl.int64) * (E + 2)
    tl.store(out_row + e, counts, mask=e < E)
    tl.store(out_row + E, zsum)
    tl.store(out_row + E + 1, msum)


@hot_path
def router_partials(
    logits: torch.Tensor, top_k: int, softmax: bool, gate: torch.Tensor | None = None
) -> torch.Tensor:
    """Partials ``[ceil(T / 64), E + 2]`` of router logits ``[T, E]``. ``gate``: a
    float64 device flag; at 0 the kernel returns at once, the partials unwritten."""
    n_tokens, n_experts = logits.shape
    n_blocks = triton.cdiv(n_tokens, _BLOCK_T)
    out = torch.empty((n_blocks, n_experts + 2), dtype=torch.float32, device=logits.device)
    _router_kernel[(n_blocks,)](
        out if gate is None else gate, logits, out, n_tokens, n_experts, *logits.stride(),
        TOP_K=top_k, SOFTMAX=softmax, BLOCK_T=_BLOCK_T,
        BLOCK_E=max(2, triton.next_power_of_2(n_experts)), GATED=gate is not None,
    )  # fmt: skip
    return out


@hot_path
def router_partials_grouped(
    first: torch.Tensor,
    offsets: torch.Tensor,
    n_layers: int,
    top_k: int,
    softmax: bool,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Partials ``[ceil(T / 64), L * (E + 2)]`` of ``L`` layers' router logits ``[T, E]``
    in one launch (layer ``l`` at ``offsets[l]`` elements from ``first``, same shape,
    dtype and strides)."""
    n_tokens, n_experts = first.shape
    n_blocks = triton.cdiv(n_tokens, _BLOCK_T)
    width = n_experts + 2
    out = torch.empty((n_blocks, n_layers * width), dtype=torch.float32, device=first.device)
    _router_grouped_kernel[(n_blocks, n_layers)](
        out if gate is None else gate, first, offsets, out, n_tokens, n_experts,
        *first.stride(), n_layers * width, TOP_K=top_k, SOFTMAX=softmax, BLOCK_T=_BLOCK_T,
        BLOCK_E=max(2, triton.next_power_of_2(n_experts)), ALIGN=16 // first.element_size(),
        GATED=gate is not None,
    )  # fmt: skip
    return out
