"""``SynclessMegatron`` in Megatron-core's own pipeline schedules, 2 gloo ranks: 1F1B,
and interleaved 1F1B over virtual chunks (the last test).

Pipeline parallel 2 with 4 micro-batches: each stage holds 2 of the 4 layers. The
loop trains, validates (``forward_only=True``) while captures overflow the capture
engine's ring, then trains again. Checked against what the schedule did: the window
pattern is one window after each pipeline communication, learnt in the first
iteration; validation publishes no boundary and its capacity flushes leave the
windows alive (three such flushes in training would end them: the bug this guards
against); the monitors' records cover every stage's layers by Megatron's layer number;
the profiler has the schedule's sections.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_harness import (
    Parallel,
    batch,
    cuda_to_cpu,
    gpt_config,
    gpt_model,
    init_parallel,
)

from syncless.capture import CaptureEngine, MemorySink
from syncless.integrations.megatron import SynclessMegatron
from syncless.profile import Profiler
from syncless.run import Run
from syncless.testing import spawn_gloo

pytestmark = pytest.mark.dist

SEQ, MICRO_BATCHES = 16, 4
VALIDATION_RECORD = torch.zeros(1024)  # 4 KiB: the 8 KiB ring fills every other one


class CountingTimers:
    """Megatron's ``Timers`` as far as the schedule uses it: counts each name's starts.
    The integration must chain to it (Megatron-LM's own timers keep working)."""

    def __init__(self) -> None:
        self.starts: dict[str, int] = {}

    def __call__(self, name: str, log_level: int | None = None, barrier: bool = False):
        timers = self

        class Timer:
            def start(self, barrier: bool = False) -> None:
                timers.starts[name] = timers.starts.get(name, 0) + 1

            def stop(self, barrier: bool = False) -> None:
                pass

        return Timer()

    def communications(self) -> int:
        return sum(n for name, n in self.starts.items() if name.endswith(("-send", "-recv")))


def _loss(labels_mask: torch.Tensor, output: torch.Tensor):
    loss = output.float().mean()
    return loss, {"loss": loss.detach().clone()}


def _forward_step(engine: CaptureEngine | None, tag: str, data_iterator, model):
    tokens, positions, labels, mask = next(data_iterator)
    if engine is not None:
        engine.capture(tag, VALIDATION_RECORD if tag == "val" else tokens.float())
    output = model(tokens, positions, mask, labels=labels)
    return output, partial(_loss, mask)


def _run_rank(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    parallel = Parallel(pp=2)
    init_parallel(parallel)
    counting = CountingTimers()
    config = gpt_config(layers=4, parallel=parallel, batch_p2p_comm=False, timers=counting)
    torch.manual_seed(rank)
    model = gpt_model(
        config,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    engine = CaptureEngine(8 << 10, 4 << 10, MemorySink(), device="cpu")
    profiler = Profiler(mode="events", report_every=1000)
    syncless = SynclessMegatron(
        [model], opt, run=Run(run_dir=run_dir), budget=None, profiler=profiler, capture=engine
    )
    forward_backward = syncless.forward_backward(get_forward_backward_func())
    out: dict[str, Any] = {}
    names: set[str] = set()

    def iteration(tag: str, step: int, forward_only: bool = False) -> None:
        data = iter([batch(step * 10 + i, seq=SEQ) for i in range(MICRO_BATCHES)])
        forward_backward(
            forward_step_func=partial(_forward_step, engine, tag),
            data_iterator=data,
            model=[model],
            num_microbatches=MICRO_BATCHES,
            seq_length=SEQ,
            micro_batch_size=2,
            forward_only=forward_only,
        )

    with cuda_to_cpu():
        for step in range(3):
            iteration("train", step)
            if step == 0:
                out["communications"] = counting.communications()
            syncless.optimizer_step(opt)
            names.update(r.name for r in syncless.step(step))
        out["pattern"] = engine.controller.pattern
        before = engine.counters()
        with torch.no_grad():
            iteration("val", 100, forward_only=True)
        during = engine.counters()
        for step in range(3, 6):
            iteration("train", step)
            syncless.optimizer_step(opt)
            names.update(r.name for r in syncless.step(step))
        report = profiler.report(5, force=True)
    engine.flush()
    after = engine.counters()
    syncless.close()
    engine.close()
    out.update(
        before=before,
        during=during,
        after=after,
        fallback=engine.controller.fallback,
        records=sorted(names),
        sections=[row.name for row in report.rows],
        misuse=report.values.get("profile/self/misuse_count"),
        timers_restored=config.timers is counting,
        validations=syncless.validations,
    )
    return out


def test_windows_survive_validation_and_every_stage_is_monitored(tmp_path):
    ranks = spawn_gloo(_run_rank, 2, str(tmp_path / "run"), timeout_s=240)
    for rank in ranks:
        # A start and a stop per send or receive the schedule timed (its own count,
        # through the timers the integration chains to); a window after each.
        period = 2 * rank["communications"]
        assert period >= 8  # 1F1B, 4 micro-batches: at least one per micro-batch
        pattern = rank["pattern"]
        assert pattern.period == period
        assert [tuple(w) for w in pattern.windows] == [(b, b + 1) for b in range(1, period, 2)]
        before, during, after = rank["before"], rank["during"], rank["after"]
        # Validation published no boundary; its captures (twice the ring) went out by
        # plain batching, not as capacity flushes against windows that never open
        # (three of those would have ended the windows for good).
        assert during["boundary_count"] == before["boundary_count"]
        assert during["d2h_batch_bytes"] - before["d2h_batch_bytes"] >= 2 * 4096
        assert during["flush_capacity_count"] == before["flush_capacity_count"]
        assert not rank["fallback"]
        # Training after it: 3 more iterations of boundaries, windows granted again.
        assert after["boundary_count"] - during["boundary_count"] == 3 * period
        grants = after["window_grants_count"] + after["window_missed_count"]
        assert grants > during["window_grants_count"] + during["window_missed_count"]
        assert rank["validations"] == 1 and rank["timers_restored"]
        for section in ("forward-compute", "backward-compute", "forward-send", "backward-recv"):
            assert section in rank["sections"]
        assert rank["misuse"] == 0  # validation's timers open no section outside a step
    names = ranks[0]["records"]
    for layer in range(4):  # stage 0 holds layers 0-1, stage 1 layers 2-3
        assert f"monitors/layer_{layer:02d}/act_absmax" in names
        assert f"monitors/layer_{layer:02d}/attn_qk_logit_max" in names
        assert f"monitors/layer_{layer:02d}/param_norm" in names


def _run_virtual_rank(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    """Pipeline 2 x 2 virtual chunks, 4 layers: rank 0 holds layers 0 and 2, rank 1
    layers 1 and 3, one chunk each; Megatron's interleaved 1F1B schedule."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    parallel = Parallel(pp=2, vpp=2)
    init_parallel(parallel)
    config = gpt_config(layers=4, parallel=parallel, batch_p2p_comm=False)
    torch.manual_seed(rank)
    chunks = [
        gpt_model(
            config,
            vp_stage=i,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i),
        )
        for i in range(2)
    ]
    outputs: dict[int, torch.Tensor] = {}

    def keep(module, args, output, layer: int) -> None:  # the test's own truth
        hidden = output[0].detach().abs().reshape(-1, output[0].shape[-1]).amax(0)
        outputs[layer] = torch.maximum(outputs.get(layer, hidden), hidden)

    for chunk in chunks:
        for block in chunk.decoder.layers:
            block.register_forward_hook(partial(keep, layer=block.layer_number - 1))
    opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=0.0)
    syncless = SynclessMegatron(chunks, opt, run=Run(run_dir=run_dir), budget=None)
    forward_backward = syncless.forward_backward(get_forward_backward_func())
    names: dict[str, Any] = {}
    with cuda_to_cpu():
        data = [batch(i, seq=SEQ) for i in range(MICRO_BATCHES)]
        forward_backward(
            forward_step_func=partial(_forward_step, None, "train"),
            data_iterator=[iter(data), iter(data)],
            model=chunks,
            num_microbatches=MICRO_BATCHES,
            seq_length=SEQ,
            micro_batch_size=2,
        )
        syncless.optimizer_step(opt)
        syncless.step(0)
    syncless.close()  # the last readout (step 0) lands here on the CPU
    readout = syncless.handle.readouts[-1]
    for layer in range(4):
        key = f"monitors/layer_{layer:02d}/act_channel_absmax"
        names[key] = readout.get(key)
    return {
        "layers": sorted(b.layer_number - 1 for c in chunks for b in c.decoder.layers),
        "truth": {k: v.double().numpy() for k, v in outputs.items()},
        "recorded": names,
    }


def test_virtual_pipeline_chunks_are_monitored_by_megatron_s_layer_numbers(tmp_path):
    ranks = spawn_gloo(_run_virtual_rank, 2, str(tmp_path / "run"), timeout_s=240)
    assert ranks[0]["layers"] == [0, 2] and ranks[1]["layers"] == [1, 3]
    for layer in range(4):
        owner = ranks[layer % 2]
        want = owner["truth"][layer]  # the max over the micro-batches on its stage
        got = ranks[0]["recorded"][f"monitors/layer_{layer:02d}/act_channel_absmax"]
        np.testing.assert_allclose(got, want, rtol=1e-6)
