"""SL005: formatting a tensor's values."""

import logging

logger = logging.getLogger(__name__)


def print_hook(module, inputs, output):
    print(output)  # expect: SL005
    print("max", output.max())  # expect: SL005
    print(inputs)  # expect: SL005
    text = f"peak={output.abs().max():.3f}"  # expect: SL005
    old = "%s" % output  # expect: SL005
    older = "%s %s" % (output.shape, output.mean())  # expect: SL005
    fmt = "{}".format(output)  # expect: SL005
    s = str(output.sum())  # expect: SL005
    r = repr(output)  # expect: SL005
    logger.info("output %s", output)  # expect: SL005
    logging.debug(f"{output}")  # expect: SL005
    # metadata is on the host already: fine
    print(f"shape={output.shape} dtype={output.dtype} n={output.numel()}")
    print("hook ran", len(inputs))
    logger.info("shape %s", output.shape)
    label = "%d inputs" % len(inputs)
    return text, old, older, fmt, s, r, label


def cold(output):
    print(output)
    return f"{output}"
