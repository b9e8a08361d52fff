"""syncless in torchtitan's Trainer with CUDA graphs on (its default), on a CPU.

The stock ``Trainer`` trains 24 steps with ``training.disable_cuda_graphs=False`` and
``SynclessMetricsProcessor`` from its job config. torchtitan's own
``wrap_with_cuda_graph`` and ``CUDAGraphWrapper`` run step 1 eagerly (the warm-up),
capture step 2 and replay it at steps 2 to 24. The few ``torch.cuda`` calls they make
are CPU stand-ins: ``CUDAGraph`` is a ``syncless.graphs.StandInGraph``, whose replays
re-run the captured ops and no Python; ``torch.cuda.graph`` is its ``capture()``; the
pool, streams and device checks are inert. That module alone sees them: the rest of
torchtitan and syncless still see a CPU.

The same run with graphs off (same seed, same data) is the reference: every monitor
records the same values at the same steps, and only at its active steps. A NaN
planted in one replayed step is reported with that step and layer.

Test shims beside ``torchtitan_harness.trainer_on_cpu``'s: the model spec's
``parallelize_fn`` is the identity. torchtitan applies FSDP2 even on one rank, and
FSDP2 frees parameter storage after each forward and backward and reallocates it
before the next. A CUDA graph replays on addresses its private pool keeps; the
stand-in replays on the tensors, whose storage is gone after the capture.
"""

from __future__ import annotations

import contextlib
import math
import types

import pytest

pytest.importorskip("torchtitan")

from syncless.run import open as open_run
from syncless.testing import spawn_gloo

STEPS = 24
LAYERS = 2  # torchtitan_harness's models
# Distinct cadences, so that each monitor's device gate opens on its own steps.
CADENCES = {"attention": 2, "moe": 3, "activations": 4, "nonfinite": 4, "norms": 5}
NAN_STEP = 7  # replayed; no norms step, no log step (log_freq 5)
NAN_LAYER = 1
LOG_FREQ = 5


class _Stream:
    def wait_stream(self, other: object) -> None:
        pass


class StandInCuda:
    """The ``torch.cuda`` calls of torchtitan/distributed/cudagraph.py, on a CPU."""

    Stream = _Stream

    def __init__(self) -> None:
        self.graphs: list = []

    def is_available(self) -> bool:
        return True

    def CUDAGraph(self):  # torch.cuda.CUDAGraph
        from syncless.graphs import StandInGraph

        self.graphs.append(StandInGraph())
        return self.graphs[-1]

    def graph(self, graph, pool=None, stream=None, capture_error_mode="global"):
        return graph.capture()

    def graph_pool_handle(self) -> object:
        return object()

    def current_stream(self) -> _Stream:
        return _Stream()

    def stream(self, stream: _Stream) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


def _with_stand_in_cuda(monkeypatch: pytest.MonkeyPatch) -> StandInCuda:
    """torchtitan's cudagraph module sees ``torch`` with the stand-in ``cuda``."""
    import torch
    import torchtitan.distributed.cudagraph as cudagraph

    class TorchWithStandInCuda(types.ModuleType):
        def __getattr__(self, name: str):
            return getattr(torch, name)

    stand_in = StandInCuda()
    proxy = TorchWithStandInCuda("torch")
    proxy.cuda = stand_in  # type: ignore[attr-defined]
    monkeypatch.setattr(cudagraph, "torch", proxy)
    monkeypatch.setattr(cudagraph, "utils", types.SimpleNamespace(device_type="cuda"))
    return stand_in


def _with_cadences(monkeypatch: pytest.MonkeyPatch) -> None:
    """The processor's monitors at ``CADENCES`` (its config sets one ``every``)."""
    import syncless.integrations.session as session

    build = session.build

    def build_at_cadences(*args, **kwargs):
        monitors = build(*args, **kwargs)
        for m in monitors:
            m.every = CADENCES.get(m.name, m.every)
        return monitors

    monkeypatch.setattr(session, "build", build_at_cadences)


def _train(family: str, graphs: bool, run_dir: str) -> dict:
    """The stock Trainer for ``STEPS`` steps; what the test reads besides the run."""
    import torch
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import TrainingConfig
    from torchtitan.config.configs import DebugConfig
    from torchtitan.trainer import Trainer
    from torchtitan_harness import NoTokenizer, RandomTokens, model_spec, trainer_on_cpu

    from syncless.integrations.torchtitan import SynclessMetricsProcessor

    with pytest.MonkeyPatch.context() as monkeypatch:
        trainer_on_cpu(monkeypatch)
        stand_in = _with_stand_in_cuda(monkeypatch)
        _with_cadences(monkeypatch)
        config = Trainer.Config(
            model_spec=model_spec(family, parallelize_fn=lambda model, **kwargs: model),
            tokenizer=NoTokenizer.Config(),
            dataloader=RandomTokens.Config(seed=1),
            loss=CrossEntropyLoss.Config(),
            optimizer=default_adamw(lr=1e-3),
            training=TrainingConfig(
                local_batch_size=2, seq_len=16, steps=STEPS, disable_cuda_graphs=not graphs
            ),
            metrics=SynclessMetricsProcessor.Config(
                run_dir=run_dir, budget=None, log_freq=LOG_FREQ
            ),
            debug=DebugConfig(seed=0),
            dump_folder=f"{run_dir}-dump",
        )
        trainer = Trainer(config)
        # Registered before the processor attaches (at step 1's should_log): a fault
        # the monitors see, captured with the step. Its factor is 1, or NaN in the
        # batch of NAN_STEP, whose update is skipped: training is clean again after.
        factor = torch.ones(())
        layer = trainer.model_parts[0].layers[str(NAN_LAYER)]
        layer.register_forward_hook(lambda module, args, out: out * factor)
        calls = [0]  # the hooks' Python runs eagerly, and at capture, never in a replay
        trainer.model_parts[0].layers["0"].register_forward_hook(
            lambda *args: calls.__setitem__(0, calls[0] + 1)
        )
        data = trainer.dataloader

        def batches():
            for step, batch in enumerate(data, start=1):
                factor.fill_(math.nan if step == NAN_STEP else 1.0)
                yield batch

        trainer.dataloader = batches()
        optimizer_step = trainer.optimizers.step
        trainer.optimizers.step = lambda: None if trainer.step == NAN_STEP else optimizer_step()
        losses = {}
        log = trainer.metrics_processor.log

        def logged(step, global_avg_loss, *args, **kwargs):
            losses[step] = global_avg_loss
            return log(step, global_avg_loss, *args, **kwargs)

        trainer.metrics_processor.log = logged
        trainer.train()
        handle = trainer.metrics_processor.session.handle
        trainer.close()
        alarm = handle.alarm
        return {
            "replays": [g.replays for g in stand_in.graphs],
            "hook_calls": calls[0],
            "graphed": handle.ctx.graphed,
            "losses": losses,
            "events": [(e.first_step, e.first_layer) for e in alarm.events] if alarm else [],
        }


def _both(rank: int, world: int, family: str, tmp: str) -> tuple[dict, dict]:
    return _train(family, False, f"{tmp}/eager"), _train(family, True, f"{tmp}/graphs")


def _records(run_dir: str) -> dict[tuple[int, str], float]:
    with open_run(run_dir) as store:
        _, rows = store.query(
            "SELECT step, name, value FROM metrics "
            "WHERE name LIKE 'monitors/%' AND name NOT LIKE 'monitors/self/%'"
        )
    return {(step, name): value for step, name, value in rows}


def _steps(records: dict, name: str) -> list[int]:
    return sorted(step for step, key in records if key == name)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "qwen3-moe"])
def test_the_processor_records_in_replayed_steps_what_an_eager_run_records(family, tmp_path):
    eager, graphs = spawn_gloo(_both, 1, family, str(tmp_path), timeout_s=300)[0]
    # the wrapper ran: one warm-up, one capture (torchtitan's manager captures an empty
    # graph first, never replayed), a replay at each later step
    assert graphs["replays"] == [0, STEPS - 1]
    assert eager["replays"] == []
    assert (eager["hook_calls"], graphs["hook_calls"]) == (STEPS, 2)
    assert graphs["graphed"] and not eager["graphed"]
    assert graphs["losses"].keys() == eager["losses"].keys() == {1, 5, 10, 15, 20}
    for step, loss in eager["losses"].items():
        assert math.isclose(graphs["losses"][step], loss, rel_tol=1e-6), step

    want, got = _records(str(tmp_path / "eager")), _records(str(tmp_path / "graphs"))
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=1e-5, abs_tol=1e-9) or (
            math.isnan(value) and math.isnan(got[key])
        ), (key, value, got[key])

    # each monitor at its active steps only (torchtitan's steps, from 1)
    watching = [name for name in CADENCES if name != "moe" or family == "qwen3-moe"]
    active = {name: list(range(1, STEPS + 1, CADENCES[name])) for name in watching}
    # the alarm counts at every step; its counts are read at every flush, and at close
    flushes = sorted({s for steps in active.values() for s in steps} | {STEPS})
    for layer in range(LAYERS):
        scope = f"monitors/layer_{layer:02d}"
        assert _steps(got, f"{scope}/attn_qk_logit_max") == active["attention"]
        assert _steps(got, f"{scope}/moe_imbalance") == active.get("moe", [])
        assert _steps(got, f"{scope}/act_absmax") == active["activations"]
        assert _steps(got, f"{scope}/param_norm") == active["norms"]
        assert _steps(got, f"{scope}/nonfinite_count") == flushes

    # the NaN of one replay: its step and layer, at the first readout from its step on
    read = min(s for s in flushes if s >= NAN_STEP)
    first = {k.rsplit("_", 1)[1]: (s, v) for (s, k), v in got.items() if "nonfinite_first_" in k}
    assert first == {"step": (read, NAN_STEP), "layer": (read, NAN_LAYER)}
    assert graphs["events"] == eager["events"] == [(NAN_STEP, NAN_LAYER)]
    assert got[read, f"monitors/layer_{NAN_LAYER:02d}/nonfinite_count"] > 0
    assert got[read, "monitors/layer_00/nonfinite_count"] == 0
