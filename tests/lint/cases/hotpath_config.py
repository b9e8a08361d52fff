# case-config: hot-path-patterns = on_step_*, Trainer.observe
"""Configured hot-path patterns match function names or qualified names."""


def on_step_end(loss):
    return loss.item()  # expect: SL001


class Trainer:
    def observe(self, x):
        return x.item()  # expect: SL001

    def log(self, x):
        return x.item()


def observe(x):
    # `Trainer.observe` matches the qualified name only: cold.
    return x.item()
