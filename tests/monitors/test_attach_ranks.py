"""attach() on several ranks: the same monitors everywhere, or one clear error (#20)."""

from __future__ import annotations

import pytest
import torch

from syncless.demo.config import preset
from syncless.demo.model import MoETransformer
from syncless.monitors import attach, build
from syncless.testing import spawn_gloo


def _mismatched_rank(rank: int, world: int) -> str:
    from syncless.errors import UsageError

    cfg = preset("tiny")
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    names = ["attention"] if rank == 0 else ["attention", "moe"]
    try:
        attach(model, build(names), lagged=False, budget=None)
    except UsageError as e:
        return str(e)
    return "attached"


@pytest.mark.dist
def test_ranks_that_attach_different_monitors_get_one_clear_error_each():
    messages = spawn_gloo(_mismatched_rank, 2)
    assert messages[0] == messages[1] != "attached"
    assert "rank 0: attention every 1, budget None; rank 1: attention every 1, moe" in messages[0]


def _stage(rank: int, world: int, moe_ranks: tuple[int, ...]) -> tuple[dict, dict]:
    """A pipeline stage of 2 demo blocks per rank (layers 2r, 2r+1): MoE blocks on the
    ranks in ``moe_ranks``, dense ones elsewhere."""
    from matrix_models import DenseMLP

    from syncless import kernels
    from syncless.guard import no_sync

    kernels.set_backend("torch")
    cfg = preset("tiny")
    torch.manual_seed(rank)
    model = MoETransformer(cfg)
    if rank not in moe_ranks:
        for block in model.layers:
            block.moe = DenseMLP(cfg.d_model, cfg.expert_hidden)
    handle = attach(model, build("moe,activations"), lagged=False, budget=None,
                    layer_offsets=[2 * rank])  # fmt: skip
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(rank))
    with no_sync(cpu_as_device=True), torch.no_grad():  # the stand-in stage's own input
        for block in model.layers:
            block(model.embed(tokens))
    records = {r.name: r.value for r in handle.step(0)}
    handle.close()
    return dict(handle.idle), records


@pytest.mark.dist
def test_a_monitor_idle_on_one_stage_only_stays_on_every_rank():
    """MoE layers on rank 1 only: the moe monitor stays attached on rank 0 too (every
    rank flushes the same monitors) and the records hold rank 1's counts; dense on both
    ranks, it is left out on both."""
    (idle0, records), (idle1, _) = spawn_gloo(_stage, 2, (1,))
    assert idle0 == idle1 == {}
    k, tokens = preset("tiny").top_k, 2 * 8
    for layer in (2, 3):  # every token of rank 1's stage picks k experts
        assert records[f"monitors/layer_{layer:02d}/moe_tokens_count"] == tokens * k
    for layer in (0, 1):
        assert f"monitors/layer_{layer:02d}/moe_tokens_count" not in records
        assert f"monitors/layer_{layer:02d}/act_absmax" in records
    (idle0, records), (idle1, _) = spawn_gloo(_stage, 2, ())
    assert idle0.keys() == idle1.keys() == {"moe"}
    assert not [n for n in records if "moe_" in n] and "monitors/layer_03/act_absmax" in records
