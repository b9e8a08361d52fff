"""Agree on one schema across ranks before the first collective.

Ranks compare a digest of their schemas (one small all_gather_object at allocate).
When the digests differ, the full schemas are gathered: a key declared with different
definitions, or a non-layer key missing on some ranks, raises on every rank with the
keys listed, instead of hanging in the first collective. Layer metrics that only
some ranks declare (pipeline stages, MoE layers on some ranks) are allowed: every rank
allocates the union, and ranks without a layer contribute neutral values.
"""

from __future__ import annotations

import torch.distributed as dist

from syncless.metrics.schema import MetricSpec, schema_digest


class SchemaMismatch(RuntimeError):
    pass


def agree(specs: list[MetricSpec], group: dist.ProcessGroup | None) -> list[MetricSpec]:
    """The schema every rank allocates, in a rank-independent order."""
    ordered = sorted(specs, key=lambda s: s.key)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return ordered
    world = dist.get_world_size(group)
    digests: list[str | None] = [None] * world
    dist.all_gather_object(digests, schema_digest(ordered), group=group)  # cold path, once
    if len(set(digests)) == 1:
        return ordered
    schemas: list[list[MetricSpec] | None] = [None] * world
    dist.all_gather_object(schemas, ordered, group=group)
    return _union(schemas)  # type: ignore[arg-type]


def _union(schemas: list[list[MetricSpec]]) -> list[MetricSpec]:
    by_key: dict[str, dict[int, MetricSpec]] = {}
    for rank, specs in enumerate(schemas):
        for s in specs:
            by_key.setdefault(s.key, {})[rank] = s
    conflicts, missing = [], []
    for key, per_rank in sorted(by_key.items()):
        definitions = {s.definition for s in per_rank.values()}
        if len(definitions) > 1:
            detail = ", ".join(f"rank {r}: {s.definition}" for r, s in sorted(per_rank.items()))
            conflicts.append(f"{key} ({detail})")
        first = next(iter(per_rank.values()))
        if first.layer is None and len(per_rank) < len(schemas):
            absent = sorted(set(range(len(schemas))) - set(per_rank))
            missing.append(f"{key} (not declared on ranks {absent})")
    if conflicts or missing:
        lines = [f"  declared differently: {c}" for c in conflicts]
        lines += [f"  missing: {m}" for m in missing]
        raise SchemaMismatch(
            "metric schemas differ across ranks:\n"
            + "\n".join(lines)
            + "\nEvery rank must declare the same metrics (layer metrics may be declared only "
            "by the ranks that own the layer)."
        )
    return [next(iter(per_rank.values())) for _, per_rank in sorted(by_key.items())]
