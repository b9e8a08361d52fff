"""SL009: exceptions swallowed on the hot path."""

import contextlib
import logging

log = logging.getLogger(__name__)


def guarded_hook(module, inputs, output):
    try:
        value = output.sum()
    except RuntimeError:  # expect: SL009
        pass
    try:
        value = output.mean()
    except Exception as error:  # expect: SL009
        log.warning("hook failed: %s", error)
    try:
        value = output.amax()
    except (KeyError, IndexError):  # expect: SL009
        return None
    for t in inputs:
        try:
            t.add_(1)
        except ValueError:  # expect: SL009
            continue
    with contextlib.suppress(KeyError):  # expect: SL009
        value = output.min()
    # re-raised: fine
    try:
        value = output.max()
    except KeyError as error:
        raise ValueError(f"undeclared key: {error}") from error
    try:
        value = output.abs()
    except RuntimeError:
        log.error("cannot compute abs")
        raise
    try:
        value = output.abs()
    finally:
        pass
    return value


def cold_loader(path):
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return None
