"""SL100/SL101: suppression comments need a known directive and a reason."""

import torch.distributed as dist


def noisy_hook(module, inputs, output):
    a = output.item()  # syncless: ok debug path behind a flag, never on in training
    b = output.item()  # syncless: ok  # expect: SL001, SL100
    c = output.item()  # syncless: okay fine  # expect: SL001, SL101
    d = float(output.sum())  # syncless: ok read once, at step 0 only
    e = output.item()  # syncless:  # expect: SL001, SL101
    f = (
        output.abs()
        .max()
        .item()
    )  # syncless: ok a multi-line expression is suppressed from its last line
    return a, b, c, d, e, f


def cold(output):
    # A directive without a reason is reported anywhere, hot or not:
    return output.item()  # syncless: ok  # expect: SL100


def sum_hook(module, inputs, output):
    dist.all_reduce(output)  # syncless: collective-ok  # expect: SL007, SL100
    dist.all_reduce(output)  # syncless: ok a plain suppression covers collectives too
    x = output.item()  # syncless: collective-ok only collectives  # expect: SL001
    # syncless: ok the line above does not count for a plain suppression
    y = output.item()  # expect: SL001
    return x, y
