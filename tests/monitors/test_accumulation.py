"""Gradient accumulation: micro-batches join their optimizer step (issue #20).

Ground truth: an exact recount of the routed tokens (every token picks top_k experts in
every micro-batch) and the cadence counted in optimizer steps.
"""

from __future__ import annotations

import torch

from syncless.demo.config import preset
from syncless.demo.model import MoETransformer, init_weights
from syncless.guard import no_sync
from syncless.monitors import attach, build

ACCUMULATE, OPTIMIZER_STEPS, B, L = 4, 6, 2, 16


def test_micro_batches_join_the_optimizer_step_and_cadences_count_optimizer_steps():
    cfg = preset("tiny")
    torch.manual_seed(0)
    model = MoETransformer(cfg)
    init_weights(model, 0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitors = build("moe", optimizer=opt) + build("norms", optimizer=opt, every=2)
    handle = attach(model, monitors, lagged=False, budget=None)
    flushed = {}  # optimizer step -> records
    micro = 0
    for optimizer_step in range(OPTIMIZER_STEPS):
        for i in range(ACCUMULATE):
            tokens = torch.randint(0, 256, (B, L), generator=torch.Generator().manual_seed(micro))
            with no_sync(cpu_as_device=True):
                logits, balance = model(tokens)
                (logits.float().square().mean() + balance).backward()
            last = i == ACCUMULATE - 1
            if last:
                with no_sync(cpu_as_device=True):
                    opt.step()
                opt.zero_grad(set_to_none=True)
            # a framework hook: called after every micro-batch, told which is which
            records = handle.step(micro, accumulate=not last)
            if last:
                flushed[optimizer_step] = {r.name: r.value for r in records}
            else:
                assert len(records) == 0
            micro += 1
    handle.close()
    assert handle.optimizer_steps == OPTIMIZER_STEPS
    assert handle.micro_steps == OPTIMIZER_STEPS * (ACCUMULATE - 1)
    for step, records in flushed.items():
        for layer in range(cfg.n_layers):  # every micro-batch's tokens, each top_k times
            count = records[f"monitors/layer_{layer:02d}/moe_tokens_count"]
            assert count == ACCUMULATE * B * L * cfg.top_k
        # norms every 2 optimizer steps: 0, 2, 4 (not every 2 step calls)
        assert ("monitors/global/param_norm" in records) == (step % 2 == 0)
