"""find_layers: adapter order, registration, unknown models, pipeline chunks, wrappers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from syncless.demo.config import preset
from syncless.demo.model import MoETransformer
from syncless.errors import UsageError
from syncless.monitors.adapters import ModelMap, find_layers, register_adapter, registry


@pytest.fixture(autouse=True)
def _restore_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_ADAPTERS", list(registry._ADAPTERS))


def demo(n_layers: int = 4) -> MoETransformer:
    return MoETransformer(preset("tiny", n_layers=n_layers, d_model=16, n_heads=2, seq_len=8))


def chunk(layers: list[nn.Module]) -> nn.Module:
    """A pipeline stage holding some of the model's blocks."""
    stage = nn.Module()
    stage.layers = nn.ModuleList(layers)
    return stage


def test_unknown_model_names_what_was_looked_for() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(UsageError) as err:
        find_layers(model)
    msg = str(err.value)
    assert "no registered adapter recognises Sequential" in msg
    for expected in (
        "syncless-demo:",
        "huggingface:",
        "torch-mha:",
        "q_proj",
        "self_attn",
        "torch.nn.MultiheadAttention",
        "register_adapter",
        "docs/adapters.md",
    ):
        assert expected in msg


def test_registered_adapter_is_tried_first_and_replaces_by_name() -> None:
    class Everything:
        name = "everything"
        looked_for = "anything at all"

        def __init__(self, width: int) -> None:
            self.width = width

        def matches(self, model: nn.Module) -> bool:
            return True

        def map(self, model: nn.Module, first_layer: int = 0) -> ModelMap:
            return ModelMap(adapter=self.name, layers=[], d_model=self.width)

    register_adapter(Everything(1))
    assert find_layers(demo()).d_model == 1  # ahead of the built-in demo adapter
    register_adapter(Everything(2), first=False)  # same name: replaced, now last
    assert find_layers(demo()).adapter == "syncless-demo"
    assert find_layers(nn.Linear(2, 2)).d_model == 2
    assert [a.name for a in registry.registered_adapters()][-1] == "everything"
    with pytest.raises(UsageError, match="needs an object with a `name`"):
        register_adapter(object())  # type: ignore[arg-type]


def test_chunks_are_numbered_in_order_or_by_offsets() -> None:
    model = demo(4)
    blocks = list(model.layers)
    chunks = [chunk(blocks[:1]), chunk(blocks[1:3]), chunk(blocks[3:])]

    mm = find_layers(chunks)
    assert mm.adapter == "syncless-demo" and mm.d_model == 16
    assert [s.index for s in mm.layers] == [0, 1, 2, 3]
    assert [s.attention.layer for s in mm.layers] == [0, 1, 2, 3]
    assert [s.router.layer for s in mm.layers] == [0, 1, 2, 3]
    assert [s.block for s in mm.layers] == blocks

    # interleaved pipeline: this rank holds layers 0, 4-5 and 9 of a deeper model
    mm = find_layers(chunks, layer_offsets=[0, 4, 9])
    assert [s.index for s in mm.layers] == [0, 4, 5, 9]
    assert find_layers(model, layer_offsets=[7]).layers[0].index == 7

    with pytest.raises(UsageError, match="overlap"):
        find_layers(chunks, layer_offsets=[0, 1, 2])
    with pytest.raises(UsageError, match="3 chunks but 2 layer_offsets"):
        find_layers(chunks, layer_offsets=[0, 4])
    with pytest.raises(UsageError, match="non-empty list"):
        find_layers([])
    with pytest.raises(UsageError, match="different model widths"):
        find_layers([chunks[0], chunk(list(MoETransformer(preset("tiny", n_layers=1)).layers))])


def test_wrapped_models_and_blocks_are_seen_through() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = demo(2)
    inner = model.layers[0]
    model.layers[0] = checkpoint_wrapper(inner)
    mm = find_layers(model)
    assert mm.layers[0].block is model.layers[0]  # the wrapper: its output is the block's
    assert mm.layers[0].attention.module is inner.attn

    seen = []
    mm.layers[0].attach_output(seen.append)
    mm.layers[0].attention.attach_qk(lambda q, k: seen.append(q))
    model(torch.randint(0, 256, (1, 8)))
    assert len(seen) == 2


def test_adapters_import_without_transformers() -> None:
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from syncless.monitors.adapters import find_layers\n"
        "from syncless.demo.config import preset\n"
        "from syncless.demo.model import MoETransformer\n"
        "import torch\n"
        "m = MoETransformer(preset('tiny', n_layers=1))\n"
        "print(find_layers(m).adapter, find_layers(torch.nn.MultiheadAttention(8, 2)).adapter)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["syncless-demo", "torch-mha"]
