"""How each parameter is laid out across ranks, read from the objects themselves.

The norms monitor adds sums of squares across ranks: a replicated parameter (DDP,
FSDP's NO_SHARD) is identical everywhere and is counted once (a ``max`` metric); a
sharded one (FSDP2, FSDP1, tensor parallel, expert parallel) is a ``sum`` metric that
adds each rank's shard. Where every shard lives on several ranks (HSDP: FSDP2 on a
``(replicate, shard)`` mesh, FSDP1's ``HYBRID_SHARD``), the sum counts each shard
``replicas`` times and the record divides by it.

The sources, in order: a DTensor's placements (FSDP2, tensor parallel); FSDP1's handles
(the ``FlatParameter`` when ``use_orig_params=False``, the original parameters that view
it when ``True``); and for plain tensors that differ across ranks without saying so
(expert-parallel experts), the layout the model's adapter reads from the parameters
(``ModelMap.param_layout``: Megatron marks its tensor- and expert-parallel ones), then
the user's ``is_sharded`` predicate. Issue #20: FSDP1 norms
were silently wrong without a hand-written predicate, and HSDP's were sqrt(2) too large.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from syncless.monitors.norms_passes import DTensor


@dataclass(frozen=True)
class Layout:
    """``sharded``: the ranks hold different parts (sum over ranks); ``replicas``: how
    many ranks hold each part (the sum divides by it)."""

    sharded: bool
    replicas: int = 1


REPLICATED = Layout(False)


def dtensor_layout(p: torch.Tensor) -> Layout | None:
    """A DTensor's layout from its placements; None for a plain tensor."""
    if not isinstance(p, DTensor):
        return None
    placements = p.placements
    if all(pl.is_replicate() for pl in placements):
        return REPLICATED
    mesh = p.device_mesh
    replicas = math.prod(mesh.size(d) for d, pl in enumerate(placements) if pl.is_replicate())
    return Layout(True, replicas)


def fsdp1_layouts(roots: Iterable[nn.Module]) -> dict[int, Layout]:
    """``id(tensor) -> Layout`` for every FlatParameter under ``roots`` and the original
    parameters viewing it (``use_orig_params=True``), from FSDP1's handles."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp import ShardingStrategy
    except ImportError:  # a torch build without distributed
        return {}
    hybrid = {ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2}
    out: dict[int, Layout] = {}
    for root in roots:
        for fsdp in FSDP.fsdp_modules(root):
            handle = fsdp._handle
            if handle is None:  # a wrapper with no parameters of its own
                continue
            layout = REPLICATED
            if handle.uses_sharded_strategy and handle.world_size > 1:
                replicas = 1
                if fsdp.sharding_strategy in hybrid:
                    replicas = fsdp._inter_node_pg.size()
                layout = Layout(True, replicas)
            flat = handle.flat_param
            out[id(flat)] = layout
            for p in flat._params or []:
                out[id(p)] = layout
    return out


def is_flat_param(p: torch.Tensor) -> bool:
    """An FSDP1 ``FlatParameter`` (``use_orig_params=False``): one 1-D shard of many
    original parameters, described by its metadata."""
    return hasattr(p, "_shard_param_infos") and hasattr(p, "_param_infos")


def flat_param_layout(p: torch.Tensor) -> Layout:
    """A FlatParameter no handle under the attached model describes: sharded when its
    shard is smaller than the whole (replicas unknown: taken as 1)."""
    return Layout(bool(p._sharded_size != p._unpadded_unsharded_size))


@dataclass(frozen=True)
class Piece:
    """One original parameter's part of this rank's FlatParameter shard."""

    module: nn.Module  # the module the original parameter belongs to
    offset: int  # into the local shard
    numel: int


def flat_param_pieces(p: torch.Tensor) -> list[Piece]:
    """The original parameters' parts in this rank's shard of FlatParameter ``p``
    (``p[offset : offset + numel]``); the padding is in none of them."""
    return [
        Piece(info.module, shard.offset_in_shard, shard.numel_in_shard)
        for info, shard in zip(p._param_infos, p._shard_param_infos, strict=True)
        if shard.in_shard and shard.numel_in_shard
    ]


@dataclass(frozen=True)
class Member:
    """One tensor the norms monitor reads: a parameter, or an original parameter's
    ``(offset, numel)`` view of a FlatParameter shard that spans several layers."""

    param: nn.Parameter
    layer: int
    layout: Layout
    view: tuple[int, int] | None = None


def find_members(
    params: Iterable[nn.Parameter],
    sites: Iterable,
    roots: Iterable[nn.Module],
    is_sharded: Callable[[str], bool],
    names: dict[int, str],
    model_layout: Callable[[torch.Tensor], Layout | None] | None = None,
    main_params: dict[int, tuple[nn.Parameter, Layout]] | None = None,
) -> tuple[list[Member], int]:
    """The tensors of ``params`` (the optimizer's) that belong to the mapped layers
    ``sites``, each with its layer and layout, and how many parameters lie outside every
    layer (a FlatParameter's original parameters counted one by one). A FlatParameter is split by the modules its original parameters belong
    to, unless they are all one layer's (then it is read whole: its padding is zeros)."""
    sites = list(sites)
    layer_of: dict[int, int] = {}  # a parameter two layers share: the first
    for site in sites:
        for p in site.parameters():
            layer_of.setdefault(id(p), site.index)
    module_layer = {id(m): site.index for site in sites for m in site.block.modules()}
    fsdp1 = fsdp1_layouts(roots)
    members: list[Member] = []
    seen: set[int] = set()
    outside = 0
    for p in params:
        if id(p) in seen:
            continue
        seen.add(id(p))
        if is_flat_param(p):  # FSDP1, use_orig_params=False
            layout = fsdp1.get(id(p)) or flat_param_layout(p)
            # counted as the user's parameters, the same with and without FSDP1
            outside += sum(module_layer.get(id(i.module)) is None for i in p._param_infos)
            pieces = [(module_layer.get(id(x.module)), x) for x in flat_param_pieces(p)]
            layers = {layer for layer, _ in pieces}
            if len(layers) == 1 and None not in layers:
                members.append(Member(p, layers.pop(), layout))
                continue
            views = [Member(p, layer, layout, (x.offset, x.numel)) for layer, x in pieces]
            members += [m for m in views if m.layer is not None]
            continue
        if main_params and id(p) in main_params:  # a copy the optimizer steps instead
            model_param, copy_layout = main_params[id(p)]
            layer = layer_of.get(id(model_param))
            if layer is None:
                outside += 1
            else:
                members.append(Member(p, layer, copy_layout))
            continue
        layer = layer_of.get(id(p))
        if layer is None:
            outside += 1
            continue
        layout = dtensor_layout(p) or fsdp1.get(id(p))
        if layout is None and model_layout is not None:  # the adapter knows the model's
            layout = model_layout(p)
        if layout is None:
            name = names.get(id(p), f"layers.{layer}.param")
            layout = Layout(True) if is_sharded(name) else REPLICATED
        members.append(Member(p, layer, layout))
    return members, outside
