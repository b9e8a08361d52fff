"""SL010: explicit synchronization."""

import torch


def timed_hook(module, inputs, output):
    torch.cuda.synchronize()  # expect: SL010
    torch.cuda.current_stream().synchronize()  # expect: SL010
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    start.synchronize()  # expect: SL010
    return start


def benchmark(fn):
    torch.cuda.synchronize()
    fn()
    torch.cuda.synchronize()
