"""``SynclessMegatron`` and Megatron-core's CUDA graphs (megatron-core 0.16.1), on a CPU.

Per-layer graphs are refused before anything is opened: ``cuda_graph_impl="local"``
(every scope but ``full_iteration``, and the deprecated ``enable_cuda_graph``) and
``"transformer_engine"``. One of the reasons is checked against Megatron's own code:
at a replay it asserts on the attention monitor's forward pre-hook.

One graph per iteration works. Megatron's own ``FullCudaGraphWrapper`` runs its
schedule eagerly once, captures the second iteration and replays it from then on. The
few ``torch.cuda`` calls of megatron/core/full_cuda_graph.py are CPU stand-ins:
``CUDAGraph`` is a ``syncless.graphs.StandInGraph``, whose replays re-run the captured
ops and no Python, and ``torch.cuda.graph`` is its ``capture()``. The same run without
graphs (same seed, same data) is the reference: every monitor records the same values
at the same steps, validation replays record nothing, and the losses match.

Test shims beside ``megatron_harness``'s: the models are built with
``cuda_graph_impl="none"`` and then given the graph settings. Under ``"local"`` the
``TransformerBlock`` and each ``TransformerLayer`` construct a ``CudaGraphManager``,
which asks the CUDA device and a graph-safe CUDA RNG tracker. Under ``full_iteration``
no layer gets one, and the block's serves inference only: the model trains the same.
``Tensor.cuda`` is the identity (the wrapper copies each batch into static buffers with
it).
"""

from __future__ import annotations

import contextlib
import math
import types
from functools import partial

import pytest
import torch

pytest.importorskip("megatron.core")

from integration_helpers import handed_over
from megatron_harness import (
    Parallel,
    batch,
    cuda_to_cpu,
    gpt_config,
    gpt_model,
    single_process,
)

from syncless.errors import UsageError
from syncless.graphs import StandInGraph
from syncless.guard import no_sync
from syncless.integrations.megatron import SynclessMegatron
from syncless.monitors import attach, build
from syncless.run import Run
from syncless.run import open as open_run

PER_LAYER = [
    {"cuda_graph_impl": "local"},  # the whole layer
    {"cuda_graph_impl": "local", "cuda_graph_scope": "attn"},
    {"enable_cuda_graph": True},  # deprecated: becomes "local"
    {"cuda_graph_impl": "transformer_engine"},
]


@pytest.mark.parametrize("graphs", PER_LAYER, ids=["local", "local-attn", "enable", "te"])
def test_per_layer_cuda_graphs_are_refused_before_anything_opens(graphs, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default Run would land in runs/ here
    with single_process():
        model = gpt_model(gpt_config())
        model.config = gpt_config(**graphs)  # validated by Megatron's __post_init__
        with pytest.raises(UsageError, match="full_iteration") as refused:
            SynclessMegatron([model], torch.optim.SGD(model.parameters(), lr=0.1))
        with pytest.raises(UsageError, match="full_iteration"):
            attach(model, build("activations"), budget=None)  # the adapter's own path
    assert "cuda_graph_impl='none'" in str(refused.value)
    assert not any(tmp_path.iterdir())  # no run directory
    assert not model.decoder.layers[0].self_attention.core_attention._forward_pre_hooks


def test_megatron_asserts_at_a_replay_on_the_attention_monitors_pre_hook():
    """One reason for the refusal, in Megatron's code: before each replay of a layer's
    graph, ``CudaGraphManager.call_ddp_preforward_hook`` runs on the layer and all its
    modules and asserts that every forward pre-hook is Megatron DDP's."""
    from megatron.core.transformer.cuda_graphs import CudaGraphManager

    with single_process():
        model = gpt_model(gpt_config())
        layer = model.decoder.layers[0]
        for module in layer.modules():  # Megatron's replay path, before any hook
            CudaGraphManager.call_ddp_preforward_hook(None, module)
        handle = attach(model, build("attention"), budget=None)
        with pytest.raises(AssertionError, match="user registered pre-forward hooks"):
            for module in layer.modules():
                CudaGraphManager.call_ddp_preforward_hook(None, module)
        handle.close()


# -- one graph per iteration ------------------------------------------------------------

ITERATIONS, MICRO_BATCHES = 10, 2
VALIDATE_AFTER = (3, 6)  # the first validation runs eagerly, the second is captured
LOSS_NAN, GRAD_NAN = 4, 7  # replayed iterations
CADENCES = {"attention": 2, "moe": 3, "activations": 4, "nonfinite": 4}  # norms: 10


class _Graph(StandInGraph):
    def register_generator_state(self, state: object) -> None:
        pass  # the CPU generator is not captured


class _Stream:
    def wait_stream(self, other: object) -> None:
        pass


class StandInCuda:
    """The ``torch.cuda`` calls of megatron/core/full_cuda_graph.py, on a CPU."""

    Stream = _Stream

    def __init__(self) -> None:
        self.graphs: list[_Graph] = []

    def CUDAGraph(self) -> _Graph:  # torch.cuda.CUDAGraph
        self.graphs.append(_Graph())
        return self.graphs[-1]

    def graph(self, graph, pool=None, stream=None, capture_error_mode="global"):
        return graph.capture()

    def synchronize(self) -> None:
        pass

    def current_stream(self) -> _Stream:
        return _Stream()

    def stream(self, stream: _Stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def _full_iteration_on_cpu(monkeypatch: pytest.MonkeyPatch) -> StandInCuda:
    """full_cuda_graph.py sees ``torch`` with the stand-in ``cuda``; its class-level
    state (graphs, iteration counters, static buffers) starts empty."""
    import megatron.core.full_cuda_graph as full_cuda_graph

    class TorchWithStandInCuda(types.ModuleType):
        def __getattr__(self, name: str):
            return getattr(torch, name)

    stand_in = StandInCuda()
    proxy = TorchWithStandInCuda("torch")
    proxy.cuda = stand_in  # type: ignore[attr-defined]
    monkeypatch.setattr(full_cuda_graph, "torch", proxy)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    wrapper = full_cuda_graph.FullCudaGraphWrapper
    monkeypatch.setattr(wrapper, "curr_iteration", {"training": 0, "validation": 0})
    monkeypatch.setattr(wrapper, "cuda_graph", {"training": None, "validation": None})
    monkeypatch.setattr(wrapper, "result", {"training": None, "validation": None})
    loader = full_cuda_graph.StaticBufferLoader
    monkeypatch.setattr(loader, "static_buffers", {"training": [], "validation": []})
    return stand_in


# Planted faults, set outside the graph before each iteration: 0, or NaN at LOSS_NAN
# (added to the loss: its gradient stays finite) and GRAD_NAN (to one weight's gradient).
LOSS_FAULT, GRAD_FAULT = torch.zeros(()), torch.zeros(())


def _loss(output: torch.Tensor):
    loss = output.float().mean() + LOSS_FAULT
    return loss, {"loss": loss.detach().clone()}


def _forward_step(data_iterator, model):
    data = next(data_iterator)  # the wrapper's static buffers: a dict per micro-batch
    output = model(data["tokens"], data["positions"], data["mask"], labels=data["labels"])
    return output, _loss


def _micro_batches(iteration: int) -> list[dict[str, torch.Tensor]]:
    keys = ("tokens", "positions", "labels", "mask")
    return [dict(zip(keys, batch(iteration * 10 + i), strict=True)) for i in range(MICRO_BATCHES)]


def _train(graphs: bool, run_dir: str, monkeypatch: pytest.MonkeyPatch) -> dict:
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.enums import CudaGraphScope

    import syncless.integrations.megatron as integration

    stand_in = _full_iteration_on_cpu(monkeypatch)
    monitors = integration.build

    def at_cadences(*args, **kwargs):
        built = monitors(*args, **kwargs)
        for m in built:
            m.every = CADENCES.get(m.name, m.every)
        return built

    monkeypatch.setattr(integration, "build", at_cadences)
    reduce = integration.reduced_loss

    def reduced_under_no_sync(*args, **kwargs):  # after each call, outside the graph
        with no_sync(cpu_as_device=True):
            return reduce(*args, **kwargs)

    monkeypatch.setattr(integration, "reduced_loss", reduced_under_no_sync)
    # MoE graphs need Megatron's drop-and-pad (static shapes): as its config asks
    config = gpt_config(
        experts=4, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True
    )
    torch.manual_seed(0)
    model = gpt_model(config)
    model.decoder.layers[0].self_attention.linear_qkv.weight.register_hook(
        lambda grad: grad + GRAD_FAULT
    )
    if graphs:
        config.cuda_graph_impl = "local"
        config.cuda_graph_scope = [CudaGraphScope.full_iteration]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    observer = SynclessMegatron([model], opt, run=Run(run_dir=run_dir), budget=None)
    schedule = get_forward_backward_func()
    forward_backward = observer.forward_backward(
        FullCudaGraphWrapper(schedule) if graphs else schedule
    )
    run = partial(
        forward_backward, forward_step_func=_forward_step, model=[model],
        num_microbatches=MICRO_BATCHES, seq_length=16, micro_batch_size=2,
    )  # fmt: skip
    given = handed_over(monkeypatch)
    losses, grad_norms = [], []
    for iteration in range(ITERATIONS):
        LOSS_FAULT.fill_(math.nan if iteration == LOSS_NAN else 0.0)
        GRAD_FAULT.fill_(math.nan if iteration == GRAD_NAN else 0.0)
        out = run(data_iterator=iter(_micro_batches(iteration)), forward_only=False)
        losses.append(sum(float(o["loss"]) for o in out) / MICRO_BATCHES)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads)
        grad_norms.append(float(grad_norm))
        if iteration == GRAD_NAN:
            opt.zero_grad(set_to_none=False)  # no NaN update: clean again after
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients stay where the graph writes them
        observer.step(iteration, grad_norm=grad_norm)
        if iteration in VALIDATE_AFTER:
            run(data_iterator=iter(_micro_batches(1000 + iteration)), forward_only=True)
    observer.close()
    observer.run.close()
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "given": given,
        "replays": [g.replays for g in stand_in.graphs],
    }


def _same(got: float, want: float) -> bool:
    return math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-9) or (
        math.isnan(got) and math.isnan(want)
    )


def _records(run_dir: str) -> dict[tuple[int, str], float]:
    with open_run(run_dir) as store:
        _, rows = store.query(
            "SELECT step, name, value FROM metrics "
            "WHERE name LIKE 'monitors/%' AND name NOT LIKE 'monitors/self/%'"
        )
    return {(step, name): value for step, name, value in rows}


@pytest.mark.slow
def test_full_iteration_graphs_record_what_an_eager_run_records(tmp_path):
    with single_process(), cuda_to_cpu():
        with pytest.MonkeyPatch.context() as monkeypatch:
            eager = _train(False, str(tmp_path / "eager"), monkeypatch)
        with pytest.MonkeyPatch.context() as monkeypatch:
            graphs = _train(True, str(tmp_path / "graphs"), monkeypatch)
    # training: iteration 0 eager, iteration 1 captured, a replay from then on;
    # validation: the first call eager, the second captured and replayed
    assert graphs["replays"] == [ITERATIONS - 1, 1]
    assert eager["replays"] == []
    for i, loss in enumerate(eager["losses"]):
        assert _same(graphs["losses"][i], loss), i
    # handle.step got each iteration's own loss (the mean over its micro-batches, read
    # here from the schedule's output right after the call) and gradient norm
    for run in (eager, graphs):
        assert sorted(run["given"]) == list(range(ITERATIONS))
        for i, (loss, grad_norm) in run["given"].items():
            assert _same(loss, run["losses"][i]) and _same(grad_norm, run["grad_norms"][i]), i
        nan_loss = [i for i, (loss, _) in run["given"].items() if math.isnan(loss)]
        nan_norm = [i for i, (_, norm) in run["given"].items() if math.isnan(norm)]
        assert (nan_loss, nan_norm) == ([LOSS_NAN], [GRAD_NAN])

    want, got = _records(str(tmp_path / "eager")), _records(str(tmp_path / "graphs"))
    assert got.keys() == want.keys()  # validation replays (gates off) added nothing
    for key, value in want.items():
        assert _same(got[key], value), (key, value, got[key])
    # each planted NaN with its iteration, at the alarm's first readout from it on
    readouts = sorted(s for s, k in got if k == "monitors/layer_00/nonfinite_count")
    for value, bad in (("loss", LOSS_NAN), ("grad_norm", GRAD_NAN)):
        read = min(s for s in readouts if s >= bad)
        firsts = {
            s: v for (s, k), v in got.items() if k == f"monitors/step/{value}_nonfinite_first_step"
        }
        assert firsts == {read: bad}, value
        counts = {
            s: v for (s, k), v in got.items() if k == f"monitors/step/{value}_nonfinite_count"
        }
        assert [s for s, v in counts.items() if v > 0] == [read], value
    for name, marker in {"attention": "attn_qk_logit_max", "moe": "moe_imbalance",
                         "activations": "act_absmax"}.items():  # fmt: skip
        for layer in (0, 1):
            steps = sorted(s for s, k in got if k == f"monitors/layer_{layer:02d}/{marker}")
            assert steps == list(range(0, ITERATIONS, CADENCES[name])), (name, layer)
    assert sorted(s for s, k in got if k == "monitors/layer_00/param_norm") == [0]


def test_a_full_iteration_wrapper_without_an_eager_iteration_is_refused(tmp_path):
    from megatron.core.full_cuda_graph import FullCudaGraphWrapper
    from megatron.core.pipeline_parallel import get_forward_backward_func

    with single_process():
        model = gpt_model(gpt_config())
        observer = SynclessMegatron([model], monitors="activations", run=Run(run_dir=str(tmp_path)))
        try:
            wrapper = FullCudaGraphWrapper(get_forward_backward_func(), cuda_graph_warmup_steps=0)
            with pytest.raises(UsageError, match="at least one eager iteration"):
                observer.forward_backward(wrapper)
        finally:
            observer.close()
            observer.run.close()


def test_capture_windows_under_pipeline_parallel_full_iteration_graphs_are_refused(
    tmp_path, monkeypatch
):
    """The windows follow the pipeline's communications through ``config.timers``,
    which a replayed iteration never calls."""
    monkeypatch.chdir(tmp_path)  # a default Run would land in runs/ here
    with single_process():
        model = gpt_model(gpt_config())
        model.config = gpt_config(
            parallel=Parallel(pp=2), cuda_graph_impl="local", cuda_graph_scope="full_iteration"
        )
        with pytest.raises(UsageError, match="capture=None"):
            SynclessMegatron([model], monitors="activations", run=None, capture=object())
    assert not any(tmp_path.iterdir())
