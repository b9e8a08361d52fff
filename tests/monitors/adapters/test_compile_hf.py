"""Monitors inside ``torch.compile`` add no graph break and no recompile (issue #20).

Counted with torch._dynamo's own counters on tiny Hugging Face models compiled with
the eager backend (the graph capture is what is tested, not code generation), against
the same model compiled without monitors; the statistics must equal the eager model's.
"""

from __future__ import annotations

import pytest
import torch

from syncless.monitors import attach, build

transformers = pytest.importorskip("transformers")
dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402

VOCAB = 64
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    attn_implementation="sdpa",
)  # fmt: skip


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    config = transformers.MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(config)


def _train(family: str, monitors: str | None, compiled: bool):
    model = _model(family)
    handle = None
    if monitors:
        handle = attach(model, build(monitors), lagged=False, budget=None)
    dynamo.reset()
    counters.clear()
    run = torch.compile(model, backend="eager") if compiled else model
    records = {}
    for step in range(3):
        ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(step))
        run(ids, labels=ids).loss.backward()
        if handle is not None:
            records = {r.name: r.value for r in handle.step(step)}
    if handle is not None:
        handle.close()
    breaks = sum(counters["graph_break"].values())
    return breaks, counters["stats"]["unique_graphs"], records


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "monitors"),
    [("llama", "attention,activations,nonfinite"), ("mixtral", "attention,moe,activations")],
)
def test_monitors_add_no_graph_break_and_no_recompile(family, monitors):
    bare_breaks, bare_graphs, _ = _train(family, None, compiled=True)
    breaks, graphs, compiled = _train(family, monitors, compiled=True)
    assert (breaks, graphs) == (bare_breaks, bare_graphs)
    _, _, eager = _train(family, monitors, compiled=False)
    layers = {n: v for n, v in eager.items() if n.startswith("monitors/layer_")}
    assert layers and {n: compiled[n] for n in layers} == pytest.approx(layers, rel=1e-5)


@pytest.mark.slow
def test_budget_cadences_and_sampled_attention_stay_within_dynamos_recompile_limit():
    """With the budget moving cadences and attention sampling query rows, the compiled
    layers keep a bounded set of graphs: before the fix, a host counter that rotated
    the sampling phase and free cadences (every 3 and 5) made one graph per value and
    combination, hit dynamo's recompile limit of 8, and ran the layers eagerly."""
    from syncless.monitors.activations import ActivationsMonitor
    from syncless.monitors.attention import AttentionMonitor
    from syncless.monitors.moe import MoEMonitor

    model = _model("mixtral")
    # 64 elements: every call samples rows (stride > 1), the path the counter was on
    monitors = [AttentionMonitor(max_elements=64), MoEMonitor(), ActivationsMonitor()]
    handle = attach(model, monitors, lagged=False, budget=0.01)
    dynamo.reset()
    counters.clear()
    run = torch.compile(model, backend="eager")
    seen_sets = set()
    with dynamo.config.patch(fail_on_recompile_limit_hit=True):  # raises at the limit
        _steps(run, handle, monitors, seen_sets)
    cadences = handle.cadences
    handle.close()
    assert handle.ctx.compiled
    assert all(every & (every - 1) == 0 for every in cadences.values()), cadences
    assert any(every > 1 for every in cadences.values()), cadences  # the budget acted
    assert sum(counters["graph_break"].values()) == 0
    # one graph per set of active monitors the compiled model met, prefixes of one order
    assert counters["stats"]["unique_graphs"] <= len(seen_sets) <= len(monitors) + 1


def _steps(run, handle, monitors, seen_sets: set) -> None:
    for step in range(48):
        active = {m.name for m in monitors if m.active}
        seen_sets.add(frozenset(active))
        if handle.ctx.compiled:  # nested: every active cadence below every inactive one
            every = handle.cadences
            inactive = [every[m.name] for m in monitors if m.name not in active]
            assert all(every[a] < min(inactive, default=2**31) for a in active), every
        ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(step))
        run(ids, labels=ids).loss.backward()
        handle.step(step)


@pytest.mark.slow
def test_attaching_after_the_compiled_model_ran_warns_and_strict_refuses(capsys):
    from syncless.errors import UsageError

    model = _model("llama")
    dynamo.reset()
    counters.clear()
    model.compile(backend="eager")
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    with pytest.raises(UsageError, match="after the compiled model ran"):
        attach(model, build("activations"), lagged=False, budget=None, strict=True)
    attach(model, build("activations"), lagged=False, budget=None).close()
    assert "after the compiled model ran" in capsys.readouterr().err
    # before any compiled step: no warning
    fresh = _model("llama")
    dynamo.reset()
    counters.clear()
    fresh.compile(backend="eager")
    attach(fresh, build("activations"), lagged=False, budget=None).close()
    assert "compiled" not in capsys.readouterr().err


@pytest.mark.slow
def test_the_budgets_timed_set_changing_adds_no_graph_to_the_shared_output_read():
    """On CUDA the budget times a different set of monitors from step to step
    (``Budget.timing``, empty on the CPU, so set here by hand). The output hook that
    activations and nonfinite share read that set before it checked for tracing:
    dynamo guarded on it, one graph per set, and on qwen3-1.7b (H200, 660156c) the
    hook hit the recompile limit within 60 steps and ran eagerly from then on."""
    from syncless.monitors.activations import ActivationsMonitor
    from syncless.monitors.nonfinite import NonFiniteMonitor

    model = _model("llama")
    monitors = [ActivationsMonitor(), NonFiniteMonitor()]
    handle = attach(model, monitors, lagged=False, budget=0.01)
    assert handle.ctx.batches, "the two monitors share one output read"
    dynamo.reset()
    counters.clear()
    model.compile(backend="eager")
    names = ["activations", "nonfinite", "attention", "moe", "norms"]
    sets = [frozenset(names[i] for i in range(5) if mask >> i & 1) for mask in range(12)]
    seen = set()
    with dynamo.config.patch(fail_on_recompile_limit_hit=True):  # raises at the limit
        for step, timing in enumerate(sets):
            handle.ctx.budget.timing = timing
            seen.add(tuple(m.active for m in monitors))
            ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(step))
            model(ids, labels=ids).loss.backward()
            handle.step(step)
    handle.close()
    assert handle.ctx.compiled
    # the layer's graph and the output hook's, one each per active pair the steps met
    assert counters["stats"]["unique_graphs"] <= 2 * len(seen)
