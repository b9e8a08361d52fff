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
planted in one replayed step is reported with that step and layer. The loss and
gradient norm the processor hands ``handle.step`` at every step are torchtitan's own
(the values it logs on its log steps), with llama3's steps in two gradient-accumulation
micro-batches (two replays a step, the second overwriting the first's loss); a NaN
planted in the loss alone at one step, and in one gradient alone at another, is
reported with its step.

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
CADENCES = {"attention": 2, "moe": 3, "activations": 4, "nonfinite": 4, "norms": 5, "gradients": 6}
NAN_STEP = 7  # replayed; no norms step, no log step (log_freq 5)
NAN_LAYER = 1
LOSS_NAN_STEP = 11  # the loss alone (not a log step: torchtitan stops on a NaN it logs)
GRAD_NAN_STEP = 14  # one gradient alone
LOG_FREQ = 5
MICRO_BATCHES = {"llama3": 2, "qwen3-moe": 1}  # gradient accumulation: replays per step


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


def _step_values_under_no_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The processor's per-step hooks (the loss wrapper's copy, the optimizer pre-hook,
    the flush's reduction) run under ``no_sync()``: torchtitan's own step syncs, so the
    whole step cannot."""
    from syncless.guard import no_sync
    from syncless.integrations.torchtitan import StepValues

    def guarded(method):
        def run(*args, **kwargs):
            with no_sync(cpu_as_device=True):
                return method(*args, **kwargs)

        return run

    for name in ("add_loss", "_take_grad_norm", "take"):
        monkeypatch.setattr(StepValues, name, guarded(getattr(StepValues, name)))


def _train(family: str, graphs: bool, run_dir: str) -> dict:
    """The stock Trainer for ``STEPS`` steps; what the test reads besides the run."""
    import torch
    from integration_helpers import handed_over
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
        _step_values_under_no_sync(monkeypatch)
        given = handed_over(monkeypatch)
        config = Trainer.Config(
            model_spec=model_spec(family, parallelize_fn=lambda model, **kwargs: model),
            tokenizer=NoTokenizer.Config(),
            dataloader=RandomTokens.Config(seed=1),
            loss=CrossEntropyLoss.Config(),
            optimizer=default_adamw(lr=1e-3),
            training=TrainingConfig(
                local_batch_size=2 // MICRO_BATCHES[family],
                global_batch_size=2,
                seq_len=16,
                steps=STEPS,
                disable_cuda_graphs=not graphs,
            ),
            metrics=SynclessMetricsProcessor.Config(
                run_dir=run_dir, budget=None, log_freq=LOG_FREQ
            ),
            debug=DebugConfig(seed=0),
            dump_folder=f"{run_dir}-dump",
        )
        trainer = Trainer(config)
        assert trainer.gradient_accumulation_steps == MICRO_BATCHES[family]
        # Registered before the processor attaches (at step 1's should_log): faults
        # captured with the step, whose values are set outside the graph each step.
        # The layer's factor is 1, or NaN in NAN_STEP's batches; the loss gets 0, or
        # NaN at LOSS_NAN_STEP (its gradient stays finite); one weight's gradient
        # gets 0, or NaN at GRAD_NAN_STEP. The steps with a NaN gradient zero their
        # gradients before the update: training is clean again after.
        factor, loss_fault, grad_fault = torch.ones(()), torch.zeros(()), torch.zeros(())
        layer = trainer.model_parts[0].layers[str(NAN_LAYER)]
        layer.register_forward_hook(lambda module, args, out: out * factor)
        calls = [0]  # the hooks' Python runs eagerly, and at capture, never in a replay
        trainer.model_parts[0].layers["0"].register_forward_hook(
            lambda *args: calls.__setitem__(0, calls[0] + 1)
        )
        weight = next(trainer.model_parts[0].layers["0"].parameters())
        weight.register_hook(lambda grad: grad + grad_fault)
        loss_fn = trainer.loss_fn

        def faulty_loss(*args, **kwargs):
            loss, rest = loss_fn(*args, **kwargs)
            return loss + loss_fault, rest

        trainer.loss_fn = faulty_loss
        data = trainer.dataloader

        def batches():
            for batch in data:  # fetched inside train_step: trainer.step is this step's
                factor.fill_(math.nan if trainer.step == NAN_STEP else 1.0)
                loss_fault.fill_(math.nan if trainer.step == LOSS_NAN_STEP else 0.0)
                grad_fault.fill_(math.nan if trainer.step == GRAD_NAN_STEP else 0.0)
                yield batch

        trainer.dataloader = batches()
        params = list(trainer.model_parts[0].parameters())

        def clean(optimizer, args, kwargs):  # before the processor's pre-hook
            if trainer.step in (NAN_STEP, GRAD_NAN_STEP):
                for p in params:
                    p.grad.zero_()

        trainer.optimizers.register_step_pre_hook(clean)
        losses, grad_norms = {}, {}
        log = trainer.metrics_processor.log

        def logged(step, global_avg_loss, global_max_loss, grad_norm, **kwargs):
            losses[step], grad_norms[step] = global_avg_loss, grad_norm
            return log(step, global_avg_loss, global_max_loss, grad_norm, **kwargs)

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
            "grad_norms": grad_norms,
            "given": given,
            "events": [_event(e) for e in alarm.events] if alarm else [],
        }


def _event(event) -> tuple:
    return tuple(getattr(event, name, None) for name in _EVENT_FIELDS)


_EVENT_FIELDS = ("first_step", "first_layer", "loss_first_step", "grad_norm_first_step")


def _both(rank: int, world: int, family: str, tmp: str) -> tuple[dict, dict]:
    return _train(family, False, f"{tmp}/eager"), _train(family, True, f"{tmp}/graphs")


def _records(run_dir: str) -> dict[tuple[int, str], float]:
    with open_run(run_dir) as store:
        _, rows = store.query(
            "SELECT step, name, value FROM metrics "
            "WHERE name LIKE 'monitors/%' AND name NOT LIKE 'monitors/self/%'"
        )
    return {(step, name): value for step, name, value in rows}


def _same(got: float, want: float) -> bool:
    return math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-9) or (
        math.isnan(got) and math.isnan(want)
    )


def _steps(records: dict, name: str) -> list[int]:
    return sorted(step for step, key in records if key == name)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama3", "qwen3-moe"])
def test_the_processor_records_in_replayed_steps_what_an_eager_run_records(family, tmp_path):
    eager, graphs = spawn_gloo(_both, 1, family, str(tmp_path), timeout_s=900)[0]
    # the wrapper ran: one warm-up, one capture (torchtitan's manager captures an empty
    # graph first, never replayed), then a replay for every micro-batch from the capture on
    calls = STEPS * MICRO_BATCHES[family]
    assert graphs["replays"] == [0, calls - 1]
    assert eager["replays"] == []
    assert (eager["hook_calls"], graphs["hook_calls"]) == (calls, 2)
    assert graphs["graphed"] and not eager["graphed"]
    assert graphs["losses"].keys() == eager["losses"].keys() == {1, 5, 10, 15, 20}
    for step, loss in eager["losses"].items():
        assert math.isclose(graphs["losses"][step], loss, rel_tol=1e-6), step

    # handle.step got the loss and the gradient norm at every step: torchtitan's own,
    # the values it logs (one rank: its logged loss is the rank's mean), the planted
    # NaNs at their steps and nowhere else
    for run in (eager, graphs):
        given = run["given"]
        assert sorted(given) == list(range(1, STEPS + 1))
        assert all(None not in values for values in given.values())
        for step, loss in run["losses"].items():
            assert math.isclose(given[step][0], loss, rel_tol=1e-6), step
            assert math.isclose(given[step][1], run["grad_norms"][step], rel_tol=1e-6), step
        assert [s for s, (loss, _) in given.items() if math.isnan(loss)] == [
            NAN_STEP,
            LOSS_NAN_STEP,
        ]
        assert [s for s, (_, norm) in given.items() if math.isnan(norm)] == [
            NAN_STEP,
            GRAD_NAN_STEP,
        ]
    for step, values in eager["given"].items():  # the replayed steps' own values
        for value, want in zip(graphs["given"][step], values, strict=True):
            assert _same(value, want), (step, value, want)

    want, got = _records(str(tmp_path / "eager")), _records(str(tmp_path / "graphs"))
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert _same(got[key], value), (key, value, got[key])

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
    def read(step: int) -> int:
        return min(s for s in flushes if s >= step)

    layer_nan = {
        k.rsplit("_", 1)[1]: (s, v)
        for (s, k), v in got.items()
        if k.startswith("monitors/step/nonfinite_first_")
    }
    assert layer_nan == {"step": (read(NAN_STEP), NAN_STEP), "layer": (read(NAN_STEP), NAN_LAYER)}
    assert got[read(NAN_STEP), f"monitors/layer_{NAN_LAYER:02d}/nonfinite_count"] > 0
    assert got[read(NAN_STEP), "monitors/layer_00/nonfinite_count"] == 0
    # the loss's NaNs (the layer's at NAN_STEP, the planted one) and the gradient norm's,
    # each at the first readout from its step on
    for value, steps in (
        ("loss", [NAN_STEP, LOSS_NAN_STEP]),
        ("grad_norm", [NAN_STEP, GRAD_NAN_STEP]),
    ):
        firsts = {
            s: v for (s, k), v in got.items() if k == f"monitors/step/{value}_nonfinite_first_step"
        }
        assert firsts == {read(step): step for step in steps}, value
    assert (
        graphs["events"]
        == eager["events"]
        == [
            (NAN_STEP, NAN_LAYER, NAN_STEP, NAN_STEP),
            (None, None, LOSS_NAN_STEP, None),
            (None, None, None, GRAD_NAN_STEP),
        ]
    )
