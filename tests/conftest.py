"""Without a GPU, Triton kernels run in Triton's CPU interpreter.

Set before any syncless kernel module imports triton (they import it lazily, on first
use), so CI runs the very kernel code a GPU compiles; on a CUDA machine the real
compiler is used and the interpreter stays off.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
