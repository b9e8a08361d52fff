"""syncless in torchtitan's CUDA graphs, real ones (needs a GPU and torchtitan).

torchtitan's own ``wrap_with_cuda_graph`` wraps a forward and backward of a torchtitan
llama3 built from its config (2 layers, d 256, bf16 autocast, on the GPU), and
``SynclessMetricsProcessor`` is called as torchtitan's ``Trainer.train_step`` calls it:
``should_log(step)`` before each step's forward (it attaches at step 1, before the
eager warm-up; step 2 is captured and replayed; later steps are replays), the
optimizer outside the graph, ``close()`` after the graphs' teardown. The reference is
the same 24 steps with graphs off. Training drifts a little between the two runs
(kernels may differ inside a capture), so values are compared loosely; which steps hold
records is compared exactly.

The whole ``Trainer`` is not built: it needs a tokenizer's files and a dataset. The CPU
test beside this one (test_torchtitan_graphs.py) runs it with a stand-in graph.
torchtitan 0.3 imports ``torch.distributed.fsdp.DataParallelMeshDims`` (torch 2.12) in
its FSDP helpers, which one GPU never calls; on an older torch a placeholder class
lets it import, as bench/stacks/titan_models.py does.

    PYTHONPATH=.wheels/site python -m pytest -q tests/integrations/test_torchtitan_graphs_cuda.py
"""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS, BATCH, SEQ, VOCAB, DIM, LAYERS = 24, 4, 256, 1024, 256, 2
CADENCES = {"attention": 2, "activations": 3, "nonfinite": 4, "norms": 5}
MARKERS = {
    "attention": "attn_qk_logit_max",
    "activations": "act_absmax",
    "norms": "param_norm",
}


@pytest.fixture
def titan(monkeypatch):
    """torchtitan's cudagraph module, importable on this torch."""
    pytest.importorskip("torchtitan")
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):  # torch < 2.12
        placeholder = type("DataParallelMeshDims", (), {})
        monkeypatch.setattr(fsdp, "DataParallelMeshDims", placeholder, raising=False)
    import torchtitan.distributed.cudagraph as cudagraph

    return cudagraph


def _llama3(device: torch.device) -> torch.nn.Module:
    from torch import nn
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.nn_modules import RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    init = {"weight": partial(nn.init.normal_, std=0.02)}
    layers = _build_llama3_layers(
        n_layers=LAYERS, dim=DIM, n_heads=8, n_kv_heads=4, hidden_dim=3 * DIM,
        rope=ComplexRoPE.Config(dim=DIM // 8, max_seq_len=SEQ), attn_backend="flex",
    )  # fmt: skip
    for layer in layers:  # SDPA, as bench/stacks/titan_models.py
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config = Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=init),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=init),
        layers=layers,
    )
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_states(buffer_device=device)
    return model.train()


def _processor(run_dir: str, budget: float | None):
    """``SynclessMetricsProcessor`` as the Trainer builds it from its config."""
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    from syncless.integrations.torchtitan import SynclessMetricsProcessor

    config = SynclessMetricsProcessor.Config(run_dir=run_dir, budget=budget)
    return config.build(
        parallel_dims=ParallelDims.from_config(ParallelismConfig(), 1), config_dict={}
    )


def _at_cadences(monkeypatch) -> None:
    """The processor's monitors at ``CADENCES`` (its config sets one ``every``)."""
    import syncless.integrations.session as session

    build = session.build

    def build_at_cadences(*args, **kwargs):
        monitors = build(*args, **kwargs)
        for m in monitors:
            m.every = CADENCES.get(m.name, m.every)
        return monitors

    monkeypatch.setattr(session, "build", build_at_cadences)


def _train(cudagraph, graphed: bool, run_dir: str, budget: float | None = None, steps=STEPS):
    """torchtitan's train_step calls, in its order, for ``steps`` steps."""
    device = torch.device("cuda")
    model = _llama3(device)
    calls = [0]  # the hooks' Python: the warm-up and the capture only, under graphs
    model.layers["0"].register_forward_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    processor = _processor(run_dir, budget)
    processor.model_parts, processor.optimizers = [model], opt

    def forward_backward(inputs, labels, global_valid_tokens, extra_kwargs):
        with torch.autocast("cuda", torch.bfloat16):
            pred = model(inputs, **extra_kwargs)
        loss = torch.nn.functional.cross_entropy(
            pred.flatten(0, 1).float(), labels.flatten(), reduction="sum"
        )
        loss = loss / global_valid_tokens
        loss.backward()
        return loss

    step_fn = cudagraph.wrap_with_cuda_graph(forward_backward) if graphed else forward_backward
    generator = torch.Generator().manual_seed(1)
    losses = []
    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=not graphed)  # torchtitan's: kept in place under graphs
        processor.should_log(step)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=generator).to(device)
        tokens = torch.tensor(BATCH * SEQ, device=device)
        loss = step_fn(ids[:, :-1], ids[:, 1:], tokens, {})
        losses.append(loss.detach().clone())  # the graph's output is overwritten next step
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    captured = graphed and any(w._graph is not None for w in cudagraph._manager._wrappers)
    if graphed:
        cudagraph.cudagraph_teardown()  # Trainer.close(): the graphs, then the metrics
    handle = processor.session.handle
    processor.close()
    return {
        "losses": [float(x) for x in losses],
        "hook_calls": calls[0],
        "captured": captured,
        "graphed": handle.ctx.graphed,
        "handle": handle,
    }


def _records(run_dir: str) -> dict[tuple[int, str], float]:
    from syncless.run import open as open_run

    with open_run(run_dir) as store:
        _, rows = store.query(
            "SELECT step, name, value FROM metrics "
            "WHERE name LIKE 'monitors/%' AND name NOT LIKE 'monitors/self/%'"
        )
    return {(step, name): value for step, name, value in rows}


def test_the_processor_records_in_torchtitans_graphs_what_an_eager_run_records(
    titan, monkeypatch, tmp_path
):
    _at_cadences(monkeypatch)
    eager = _train(titan, False, str(tmp_path / "eager"))
    graphs = _train(titan, True, str(tmp_path / "graphs"))
    assert graphs["captured"] and graphs["graphed"] and not eager["graphed"]
    assert (eager["hook_calls"], graphs["hook_calls"]) == (STEPS, 2)
    assert math.isclose(graphs["losses"][0], eager["losses"][0], rel_tol=1e-3)  # both eager
    for step, (got, want) in enumerate(
        zip(graphs["losses"], eager["losses"], strict=True), start=1
    ):
        assert math.isclose(got, want, rel_tol=2e-2), (step, want, got)

    want, got = _records(str(tmp_path / "eager")), _records(str(tmp_path / "graphs"))
    assert got.keys() == want.keys()
    for key, value in want.items():
        if key[1].endswith("_layer"):  # which layer holds a maximum: an argmax
            continue
        assert math.isclose(got[key], value, rel_tol=5e-2, abs_tol=5e-3), (key, value, got[key])
    for name, marker in MARKERS.items():
        for layer in range(LAYERS):
            steps = sorted(s for s, k in got if k == f"monitors/layer_{layer:02d}/{marker}")
            assert steps == list(range(1, STEPS + 1, CADENCES[name])), (name, layer, steps)
    failures = graphs["handle"].failures
    assert failures.total == 0, failures.counts


def test_the_default_budget_measures_the_replays_from_step_times(titan, tmp_path):
    graphs = _train(titan, True, str(tmp_path / "run"), budget=0.01, steps=40)
    handle = graphs["handle"]
    assert graphs["captured"] and handle.budget is not None and handle.budget.aligned
    assert {"attention", "activations"} <= handle.budget.compiled  # measured from step times
    assert all(every & (every - 1) == 0 for every in handle.cadences.values())
    assert all(math.isfinite(x) for x in graphs["losses"])
