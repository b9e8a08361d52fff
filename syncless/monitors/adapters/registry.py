"""The adapter registry and ``find_layers``: which adapter maps which model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from torch import nn

from syncless.errors import UsageError
from syncless.monitors.adapters._modules import unwrap
from syncless.monitors.adapters.sites import ModelMap


@runtime_checkable
class Adapter(Protocol):
    """Recognises one family of models and maps its layers.

    ``matches`` must be cheap and side-effect free (structure and attributes only);
    ``map`` numbers the layers from ``first_layer``. An adapter may also define a
    ``looked_for`` string, quoted in ``find_layers``' error for an unknown model.
    """

    name: str

    def matches(self, model: nn.Module) -> bool: ...

    def map(self, model: nn.Module, first_layer: int = 0) -> ModelMap: ...


_ADAPTERS: list[Adapter] = []


def register_adapter(adapter: Adapter, *, first: bool = True) -> None:
    """Add ``adapter`` to the registry; ``first=True`` tries it before the built-ins.

    Registering an adapter with the name of one already registered replaces it.
    """
    if not isinstance(adapter, Adapter):
        raise UsageError(
            f"register_adapter() needs an object with a `name` and `matches(model)` / "
            f"`map(model, first_layer=0)` methods, got {type(adapter).__name__} "
            "(see docs/adapters.md)"
        )
    _ADAPTERS[:] = [a for a in _ADAPTERS if a.name != adapter.name]
    if first:
        _ADAPTERS.insert(0, adapter)
    else:
        _ADAPTERS.append(adapter)


def registered_adapters() -> list[Adapter]:
    """The adapters ``find_layers`` tries, in order."""
    return list(_ADAPTERS)


def find_layers(
    model_or_chunks: nn.Module | Sequence[nn.Module],
    *,
    layer_offsets: Sequence[int] | None = None,
) -> ModelMap:
    """Map a model's layers with the first registered adapter that matches it.

    ``model_or_chunks`` is a model, or a list of model chunks (pipeline-parallel stages
    a rank holds). Chunks are mapped one by one and their layers numbered globally:
    chunk ``i``'s first layer gets ``layer_offsets[i]`` when given, otherwise the
    number of layers in the chunks before it. That default assumes the chunks are
    given in model order and together hold consecutive layers from layer 0; under
    interleaved pipeline parallelism a rank's chunks are *not* consecutive (rank 0 of
    4 with 2 chunks each holds layers 0-1 and 8-9 of 16, say), so pass
    ``layer_offsets`` (``[0, 8]``) to get the model's own layer numbers.

    Raises ``UsageError`` for a model no adapter recognises, naming what each
    adapter looked for.
    """
    if isinstance(model_or_chunks, nn.Module):
        if layer_offsets is not None and len(layer_offsets) != 1:
            raise UsageError(
                f"find_layers(): layer_offsets has {len(layer_offsets)} entries for one "
                "model; pass one offset, or a list of chunks"
            )
        return _map_one(model_or_chunks, layer_offsets[0] if layer_offsets else 0)

    chunks = list(model_or_chunks)
    if not chunks or not all(isinstance(c, nn.Module) for c in chunks):
        raise UsageError(
            "find_layers() needs an nn.Module or a non-empty list of nn.Module chunks, got "
            f"{type(model_or_chunks).__name__} of "
            f"{sorted({type(c).__name__ for c in chunks}) or 'nothing'}"
        )
    if layer_offsets is not None and len(layer_offsets) != len(chunks):
        raise UsageError(
            f"find_layers(): {len(chunks)} chunks but {len(layer_offsets)} layer_offsets; "
            "give one first-layer index per chunk"
        )
    maps: list[ModelMap] = []
    next_layer = 0
    for i, chunk in enumerate(chunks):
        first = layer_offsets[i] if layer_offsets is not None else next_layer
        mapped = _map_one(chunk, first)
        maps.append(mapped)
        next_layer = first + len(mapped.layers)
    return _merge(maps)


def _map_one(model: nn.Module, first_layer: int) -> ModelMap:
    inner = unwrap(model)
    for adapter in _ADAPTERS:
        if adapter.matches(inner):
            return adapter.map(inner, first_layer=first_layer)
    raise UsageError(_unknown_model_message(model))


def _merge(maps: list[ModelMap]) -> ModelMap:
    widths = {m.d_model for m in maps}
    if len(widths) != 1:
        raise UsageError(
            f"find_layers(): the chunks have different model widths {sorted(widths)}; "
            "pass chunks of one model"
        )
    layers = [layer for m in maps for layer in m.layers]
    indices = [layer.index for layer in layers]
    if len(set(indices)) != len(indices):
        raise UsageError(
            f"find_layers(): the chunks' layer numbers overlap ({indices}); check "
            "layer_offsets (one first-layer index per chunk, in the model's numbering)"
        )
    names = list(dict.fromkeys(m.adapter for m in maps))
    layouts = list(dict.fromkeys(m.param_layout for m in maps if m.param_layout is not None))
    return ModelMap(
        adapter="+".join(names),
        layers=layers,
        d_model=widths.pop(),
        param_layout=layouts[0] if len(layouts) == 1 else None,
    )


def _unknown_model_message(model: nn.Module) -> str:
    lines = [
        f"find_layers(): no registered adapter recognises {type(model).__name__}. "
        "Adapters tried, and what each looked for:"
    ]
    for adapter in _ADAPTERS:
        looked_for = getattr(adapter, "looked_for", "(no description)")
        lines.append(f"  - {adapter.name}: {looked_for}")
    children = ", ".join(f"{n} ({type(m).__name__})" for n, m in list(model.named_children())[:8])
    lines.append(f"  the model's children: {children or 'none'}")
    lines.append(
        "To monitor this model, write an adapter (an object with `name`, "
        "`matches(model)` and `map(model, first_layer=0)` returning a ModelMap) and "
        "register it: syncless.monitors.adapters.register_adapter(MyAdapter()). "
        "See docs/adapters.md."
    )
    return "\n".join(lines)
