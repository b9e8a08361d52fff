"""SL002: copies to the host."""

import numpy as np
import torch


def copy_hook(module, inputs, output):
    a = output.cpu()  # expect: SL002
    b = output.detach().tolist()  # expect: SL002
    c = output.numpy()  # expect: SL002
    d = output.to("cpu")  # expect: SL002
    e = output.to(device="cpu", non_blocking=True)  # expect: SL002
    f = output.to(torch.device("cpu"))  # expect: SL002
    g = np.asarray(output)  # expect: SL002
    h = inputs[0].cpu().numpy()  # expect: SL002
    # device to device, dtype changes and plain lists: fine
    i = output.to("cuda:0")
    j = output.to(torch.float16)
    k = output.to(device=output.device)
    m = np.asarray([1, 2, 3])
    return a, b, c, d, e, f, g, h, i, j, k, m


def flush(buffers):
    # Cold path: the one batched copy per step.
    return [b.cpu() for b in buffers]
