"""The profiler's module sections inside torch.compile add no graph break (issue #20).

Counted with torch._dynamo's counters on a tiny Hugging Face Llama compiled with the
eager backend, against the same model compiled without the profiler.
"""

from __future__ import annotations

import pytest
import torch

from syncless.profile import Profiler

transformers = pytest.importorskip("transformers")
dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402


def _compiled_steps(profiled: bool) -> tuple[int, int, dict[str, int]]:
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    prof = Profiler(mode="events", report_every=1000)
    if profiled:
        for layer in model.model.layers:
            prof.hook_module(layer, "layer")
    dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")
    for step in range(3):
        ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(step))
        with prof.step(step), prof.section("forward"):
            compiled(ids, labels=ids).loss.backward()
    report = prof.report(force=True)
    calls = {r.name: r.value for r in report if r.name.endswith("/calls_count")}
    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"], calls


def test_module_sections_add_no_graph_break_and_the_outer_section_is_timed():
    bare = _compiled_steps(profiled=False)
    breaks, graphs, calls = _compiled_steps(profiled=True)
    assert (breaks, graphs) == bare[:2]
    assert calls["profile/forward/calls_count"] == 1  # per step: timed from outside the graph
    # the traced layers are not timed: no clock read inside a graph
    assert calls.get("profile/layer/calls_count", 0) == 0
