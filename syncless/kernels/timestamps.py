"""Device timestamps for profiler sections inside captured CUDA graphs.

Two one-program kernels read the GPU's global nanosecond timer (``%globaltimer``, inline
PTX) where the stream reaches them, as an event record would be, but into memory a
graph replay rewrites. A captured span owns three int64 words of a fixed buffer at
``base``: its start stamp, its total nanoseconds, its completed replays. ``stamp_start``
writes the start stamp; ``stamp_end`` adds ``now - start`` to the total and one to the
count. The totals only grow, so a reader that keeps the last values it copied sees
how many replays ran since and how long the span took in them, without a reset.

Used by :mod:`syncless.profile.graph_sections`. NVIDIA only (PTX), and not under the
Triton interpreter, which has no inline assembly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from syncless.hot_path import hot_path

__all__ = ["stamp_end", "stamp_start"]


@triton.jit
def _now():
    # is_pure=False: each call reads the timer again, where it stands in the kernel.
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )


# ``base`` differs per span: specialising on it (a value of 1, a multiple of 16) would
# compile a variant the first time one shows up, which may be inside a capture.
@triton.jit(do_not_specialize=["base"])
def _start_kernel(stamps_ptr, base):
    tl.store(stamps_ptr + base, _now())


@triton.jit(do_not_specialize=["base"])
def _end_kernel(stamps_ptr, base):
    now = _now()
    start = tl.load(stamps_ptr + base)
    total = tl.load(stamps_ptr + base + 1)
    replays = tl.load(stamps_ptr + base + 2)
    tl.store(stamps_ptr + base + 1, total + (now - start))
    tl.store(stamps_ptr + base + 2, replays + 1)


@hot_path
def stamp_start(stamps: torch.Tensor, base: int) -> None:
    """Write the current device time into ``stamps[base]`` (int64, CUDA), stream-ordered."""
    _start_kernel[(1,)](stamps, base, num_warps=1)


@hot_path
def stamp_end(stamps: torch.Tensor, base: int) -> None:
    """Add the time since ``stamps[base]`` to ``stamps[base + 1]`` and one to
    ``stamps[base + 2]``, stream-ordered."""
    _end_kernel[(1,)](stamps, base, num_warps=1)
