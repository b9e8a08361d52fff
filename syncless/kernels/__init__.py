"""Fused Triton kernels for the monitors' hot path, and the choice of when to use them.

Each hooked module records all its statistics in two launches: a *partials* kernel that
reads the activation once and writes one row of per-block partial results per program
(``[P, N]`` float32), and :func:`syncless.kernels.fold.fold`, which reduces the partials
over ``P`` and folds them into the metric set's packed buffer (sums, exact counts and
maxima of several slots, gated by the device enable flag). The torch fallback in each
monitor launches 4-15 aten ops per module instead; on a host-bound step every launch is
host time (bench/RESULTS.md, ``monitor_kernels``).

Backend, from ``SYNCLESS_KERNELS`` or :func:`set_backend`:

* ``auto`` (default): Triton for CUDA tensors when ``triton`` imports, torch otherwise;
* ``torch``: never Triton (bisecting a kernel bug, or a platform Triton does not support);
* ``triton``: Triton for every tensor. CPU tensors need the Triton interpreter
  (``TRITON_INTERPRET=1`` set before the first import of a kernel module): that is how
  CI, which has no GPU, tests the same kernel code the GPU runs.

Inside ``torch.compile`` the torch path is used: the compiler fuses it itself, and a raw
Triton launch in a traced hook would break the graph.
"""

from __future__ import annotations

from typing import Any

import torch

from syncless.kernels.selection import (
    BACKENDS,
    backend,
    interpreting,
    set_backend,
    triton_importable,
    use_triton,
)

__all__ = [
    "BACKENDS",
    "MAX_ROUTER_EXPERTS",
    "backend",
    "band_update",
    "channel_absmax_partials",
    "channel_absmax_partials_grouped",
    "flat_view",
    "grad_stats_partials",
    "interpreting",
    "nonfinite_partials",
    "nonfinite_partials_grouped",
    "output_counts_exact",
    "output_stats_partials_grouped",
    "qk_stats_partials",
    "qk_stats_partials_grouped",
    "qk_supported",
    "rope_rotate",
    "router_partials",
    "router_partials_grouped",
    "router_supported",
    "rows_view",
    "set_backend",
    "spike_update",
    "triton_importable",
    "use_triton",
]


def qk_supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Dtypes the attention kernel handles (float64 and mixed dtypes take the torch path)."""
    return q.dtype == k.dtype and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


# One program holds a [64, next_pow2(E)] fp32 tile of scores: beyond 256 experts it
# would spill registers, and the torch path is the better choice.
MAX_ROUTER_EXPERTS = 256


def router_supported(n_experts: int) -> bool:
    return n_experts <= MAX_ROUTER_EXPERTS


# The kernel modules import triton (and read TRITON_INTERPRET when they do): import them
# on first use, so syncless imports without triton and tests can choose the interpreter.


def qk_stats_partials(*args: Any, **kwargs: Any) -> torch.Tensor:
    from syncless.kernels.attention import qk_stats_partials

    return qk_stats_partials(*args, **kwargs)


def router_partials(*args: Any, **kwargs: Any) -> torch.Tensor:
    from syncless.kernels.router import router_partials

    return router_partials(*args, **kwargs)


# ``gate``: a float64 device flag a kernel reads first, returning at once when it is 0
# (inside a CUDA graph, where the host cannot skip the launch; syncless.metrics.SlotGroup).


def channel_absmax_partials(x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    from syncless.kernels.activations import channel_absmax_partials

    return channel_absmax_partials(x, gate)


def channel_absmax_partials_grouped(
    first: torch.Tensor, offsets: torch.Tensor, n_layers: int, gate: torch.Tensor | None = None
) -> torch.Tensor:
    from syncless.kernels.activations import channel_absmax_partials_grouped

    return channel_absmax_partials_grouped(first, offsets, n_layers, gate)


def rows_view(x: torch.Tensor) -> torch.Tensor:
    from syncless.kernels.activations import rows_view

    return rows_view(x)


def nonfinite_partials(x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    from syncless.kernels.activations import nonfinite_partials

    return nonfinite_partials(x, gate)


def grad_stats_partials(g: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    from syncless.kernels.gradients import grad_stats_partials

    return grad_stats_partials(g, gate)


def flat_view(x: torch.Tensor) -> torch.Tensor:
    from syncless.kernels.activations import flat_view

    return flat_view(x)


def output_stats_partials_grouped(
    first: torch.Tensor, offsets: torch.Tensor, n_layers: int, gate: torch.Tensor | None = None
) -> torch.Tensor:
    from syncless.kernels.activations import output_stats_partials_grouped

    return output_stats_partials_grouped(first, offsets, n_layers, gate)


def output_counts_exact(rows: int, channels: int) -> bool:
    from syncless.kernels.activations import output_counts_exact

    return output_counts_exact(rows, channels)


def nonfinite_partials_grouped(
    first: torch.Tensor, offsets: torch.Tensor, n_layers: int, gate: torch.Tensor | None = None
) -> torch.Tensor:
    from syncless.kernels.activations import nonfinite_partials_grouped

    return nonfinite_partials_grouped(first, offsets, n_layers, gate)


def router_partials_grouped(*args: Any, **kwargs: Any) -> torch.Tensor:
    from syncless.kernels.router import router_partials_grouped

    return router_partials_grouped(*args, **kwargs)


def qk_stats_partials_grouped(*args: Any, **kwargs: Any) -> torch.Tensor:
    from syncless.kernels.attention import qk_stats_partials_grouped

    return qk_stats_partials_grouped(*args, **kwargs)


def band_update(*args: Any, **kwargs: Any) -> None:
    from syncless.kernels.bands import band_update

    band_update(*args, **kwargs)


def spike_update(*args: Any, **kwargs: Any) -> None:
    from syncless.kernels.bands import spike_update

    spike_update(*args, **kwargs)


def rope_rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    out_dtype: torch.dtype,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    from syncless.kernels.rope import rotate

    return rotate(x, cos, sin, out_dtype, gate)
