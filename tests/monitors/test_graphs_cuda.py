"""The monitors inside real CUDA graphs (issue #45): what the CPU stand-in tests
(tests/monitors/test_graphs.py) show, on a GPU, with torch.cuda.graph's capture modes,
a pool shared with another graph, torch.compile(mode="reduce-overhead") and an
optimizer step captured in a graph of its own.

The reference is an eager run of the same steps (same weights, same batches); the
eager values are checked against recounts by the other monitor tests. Training
diverges a little between the two runs (cuBLAS may pick other kernels inside a
capture), so values are compared loosely; which steps hold records is compared
exactly: that is where a cadence frozen at capture would show.
"""

from __future__ import annotations

import math

import pytest
import torch

from syncless import kernels
from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.monitors import attach
from syncless.monitors.activations import ActivationsMonitor
from syncless.monitors.attention import AttentionMonitor
from syncless.monitors.moe import MoEMonitor
from syncless.monitors.nonfinite import NonFiniteMonitor
from syncless.monitors.norms import NormsMonitor

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(autouse=True)
def kernel_backend(monkeypatch):
    """Overrides tests/monitors/conftest.py's torch/interpreter pair: on a GPU the
    default backend (Triton for CUDA tensors), as users run it."""
    monkeypatch.setenv("SYNCLESS_KERNELS", "auto")
    previous = kernels.backend()
    kernels.set_backend("auto")
    yield "auto"
    kernels.set_backend(previous)


STEPS = 24
VOCAB = 256
CADENCES = {"attention": 2, "moe": 3, "activations": 1, "nonfinite": 4, "norms": 5}
MARKERS = {
    "attention": "monitors/layer_00/attn_qk_logit_max",
    "moe": "monitors/layer_00/moe_imbalance",
    "activations": "monitors/layer_00/act_absmax",
    "norms": "monitors/layer_00/param_norm",
}


def _monitors(opt: torch.optim.Optimizer) -> list:
    return [
        AttentionMonitor(every=CADENCES["attention"]),
        MoEMonitor(every=CADENCES["moe"]),
        ActivationsMonitor(every=CADENCES["activations"]),
        NonFiniteMonitor(every=CADENCES["nonfinite"]),
        NormsMonitor(opt, every=CADENCES["norms"]),
    ]


def _batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (4, 64), generator=gen).cuda() for _ in range(steps)]


class Poison:
    """Multiplies a layer's output by a device scalar (1, or NaN at a chosen step),
    registered before attach: captured with the step, as a real fault would be."""

    def __init__(self, model: torch.nn.Module, layer: int) -> None:
        self.factor = torch.ones((), device="cuda")
        model.layers[layer].register_forward_hook(
            lambda m, a, out: (out[0] * self.factor, *out[1:])
        )


class Trainer:
    """torchtitan's pattern: step 0 eager on a side stream (warm-up), step 1 captured
    (into ``pool``, shared with another graph) and replayed, later steps replayed; the
    optimizer and ``handle.step`` outside the graph."""

    def __init__(
        self,
        graphed: bool,
        mode: str = "thread_local",
        compile_mode: str | None = None,
        poison: int = -1,
        monitors=None,
        **attach_kw,
    ) -> None:
        torch.manual_seed(0)
        model = MoETransformer(preset("tiny", n_layers=3, d_model=128, n_heads=4)).cuda()
        init_weights(model, 0)
        self.poison = Poison(model, poison) if poison >= 0 else None
        self.model = model
        self.forward = torch.compile(model, mode=compile_mode) if compile_mode else model
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        attach_kw.setdefault("budget", None)
        self.handle = attach(model, monitors or _monitors(self.opt), **attach_kw)
        self.graphed, self.mode = graphed, mode
        self.graph: torch.cuda.CUDAGraph | None = None
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream()
        self.tokens = torch.zeros(4, 64, dtype=torch.long, device="cuda")
        self.loss: torch.Tensor | None = None
        self.records: list = []

    def forward_backward(self) -> torch.Tensor:
        if self.forward is not self.model:
            # reduce-overhead's graphs reuse their outputs' memory at the next call: a new
            # iteration must be marked, or the backward reads a tensor that was overwritten
            # (what a user's loop does too; torch's docs for mode="reduce-overhead")
            torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", torch.bfloat16):
            logits = self.forward(self.tokens)[0]
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), self.tokens.roll(-1, dims=1).flatten()
        )
        loss.backward()
        return loss.detach()

    def step(self, i: int, batch: torch.Tensor, label: int | None = None, update=True) -> None:
        self.tokens.copy_(batch)
        if not self.graphed:
            self.loss = self.forward_backward()
        elif i == 0:
            current = torch.cuda.current_stream()
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                self.loss = self.forward_backward()
            current.wait_stream(self.stream)
        else:
            if self.graph is None:
                other = torch.cuda.CUDAGraph()  # the pool is shared, as torchtitan's is
                with torch.cuda.graph(other, pool=self.pool, stream=self.stream):
                    pass
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    self.graph, pool=self.pool, stream=self.stream, capture_error_mode=self.mode
                ):
                    self.loss = self.forward_backward()
            self.graph.replay()
        if update:
            self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        assert self.loss is not None
        self.records += self.handle.step(i if label is None else label, loss=self.loss)

    def run(self, steps: int = STEPS) -> dict[tuple[int, str], float]:
        for i, batch in enumerate(_batches(steps)):
            self.step(i, batch)
        self.records += self.handle.close()
        return _by_step(self.records)


def _by_step(records) -> dict[tuple[int, str], float]:
    return {
        (r.step, r.name): r.value
        for r in records
        if r.name.startswith("monitors/") and "/self/" not in r.name
    }


def _assert_like(graphed: dict, eager: dict) -> None:
    """The same records at the same steps; values within the runs' drift."""
    assert graphed.keys() == eager.keys()
    for key, value in eager.items():
        other = graphed[key]
        if math.isnan(value):
            assert math.isnan(other), key
            continue
        assert math.isclose(other, value, rel_tol=5e-2, abs_tol=5e-3), (key, value, other)
    for name, marker in MARKERS.items():
        steps = sorted({s for s, k in graphed if k.startswith(marker)})
        assert steps == list(range(0, STEPS, CADENCES[name])), (name, steps)


@pytest.mark.parametrize("mode", ["thread_local", "global"])
def test_every_monitor_records_in_replays_what_eager_records(mode):
    eager = Trainer(False).run()
    trainer = Trainer(True, mode=mode)
    graphed = trainer.run()
    assert trainer.handle.ctx.graphed
    _assert_like(graphed, eager)
    errors = [r.value for r in trainer.records if r.name == "monitors/self/errors_count"]
    assert errors and errors[-1] == 0


@pytest.mark.parametrize("at", [3, 11, 20])
def test_a_nan_at_any_replayed_step_is_caught_with_its_step_and_layer(at):
    trainer = Trainer(True, poison=2, monitors=[NonFiniteMonitor(every=4)])
    assert trainer.poison is not None
    for i, batch in enumerate(_batches(STEPS)):
        trainer.poison.factor.fill_(float("nan") if i == at else 1.0)
        trainer.step(i, batch, label=1 + i, update=i != at)
    trainer.records += trainer.handle.close()
    first = [r.value for r in trainer.records if r.name == "monitors/step/nonfinite_first_step"]
    layer = [r.value for r in trainer.records if r.name == "monitors/step/nonfinite_first_layer"]
    assert first == [1 + at] and layer == [2.0]


def test_under_compile_reduce_overhead():
    """torch.compile(mode="reduce-overhead") captures the compiled regions in CUDA
    graphs itself: the monitors' writes must not make it skip them, and the records
    must be those of an eager run."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = Trainer(False).run()
    trainer = Trainer(False, compile_mode="reduce-overhead")
    graphed = trainer.run()
    _assert_like(graphed, eager)
    skips = {k: v for k, v in counters["inductor"].items() if "cudagraph_skips" in k}
    assert not any(skips.values()), skips


def test_the_optimizer_step_captured_in_its_own_graph_keeps_the_norms():
    def run(graphed: bool) -> dict:
        torch.manual_seed(0)
        model = MoETransformer(preset("tiny", n_layers=3, d_model=128, n_heads=4)).cuda()
        init_weights(model, 0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, capturable=True)
        handle = attach(model, [NormsMonitor(opt, every=3)], budget=None)
        graph, stream, records = None, torch.cuda.Stream(), []
        for i, batch in enumerate(_batches(14)):
            loss = torch.nn.functional.cross_entropy(
                model(batch)[0].flatten(0, 1).float(), batch.roll(-1, dims=1).flatten()
            )
            loss.backward()
            if not graphed or i == 0:
                opt.step()
            else:
                if graph is None:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=stream):
                        opt.step()
                graph.replay()
            opt.zero_grad(set_to_none=False)
            records += handle.step(i)
        records += handle.close()
        return _by_step(records)

    eager, graphed = run(False), run(True)
    assert eager.keys() == graphed.keys() and eager
    for key, value in eager.items():
        assert math.isclose(graphed[key], value, rel_tol=1e-3), (key, value, graphed[key])
    assert {s for s, k in graphed if k.endswith("update_ratio")} == set(range(0, 14, 3))


def test_the_budget_measures_replays_from_step_times():
    trainer = Trainer(True, budget=0.01, monitors=None)
    trainer.run(steps=60)
    budget = trainer.handle.budget
    assert budget is not None and budget.aligned
    assert {"attention", "moe", "activations"} <= budget.compiled
    assert all(every & (every - 1) == 0 for every in trainer.handle.cadences.values())
    costs = {r.name for r in trainer.records if r.name.endswith("_active_cost_ms")}
    assert "monitors/self/activations_active_cost_ms" in costs


def test_capture_inside_a_graph_keeps_its_clear_error(tmp_path):
    from syncless.capture import CaptureEngine

    engine = CaptureEngine(1 << 20, 1 << 20, str(tmp_path / "run"), device="cuda")
    x = torch.ones(256, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with (
        pytest.raises(RuntimeError, match="inside CUDA graph capture"),
        torch.cuda.graph(graph),
    ):
        engine.capture("x", x, step=0)
    engine.close()
