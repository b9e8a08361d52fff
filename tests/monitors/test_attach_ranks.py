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
