"""SL008: declaring metrics after registration."""


def declare_lazily(metrics, name):
    metrics.declare(name)  # expect: SL008


class Monitor:
    def __init__(self, model, metrics):
        self.metrics = metrics
        # Registration time: the right place to declare.
        self.metrics.declare("act/peak")
        model.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        self.metrics.declare("act/late")  # expect: SL008
        self.metrics.declare_max(f"act/{module}")  # expect: SL008
        self.metrics.record("act/peak", output.abs().amax())


def _make_norm_hook(metrics, name):
    metrics.declare(f"norm/{name}")  # the factory runs at registration: fine

    def hook(module, inputs, output):
        metrics.record(f"norm/{name}", output.norm())
        declare_lazily(metrics, name)  # expect: SL008

    return hook
