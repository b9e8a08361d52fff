"""SL003: converting a tensor to a Python number."""

import math


def scalar_hook(module, inputs, output):
    peak = output.abs().max()
    a = float(peak)  # expect: SL003
    b = int(output.sum())  # expect: SL003
    c = bool((output > 0).any())  # expect: SL003
    d = math.sqrt(output.pow(2).sum())  # expect: SL003
    e = output.is_nonzero()  # expect: SL003
    for _ in range(output.argmax()):  # expect: SL003
        pass
    # metadata and Python values: fine
    n = int(output.numel())
    rows = int(output.shape[0])
    size = float(output.size(0))
    dims = int(output.dim())
    scale = float(3)
    count = int(len(inputs))
    width = math.sqrt(output.shape[-1])
    unknown = float(module.scale)  # not known to be a tensor: no finding
    return a, b, c, d, e, n, rows, size, dims, scale, count, width, unknown


def cold(t):
    return float(t.sum())
