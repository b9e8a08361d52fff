"""``syncless demo --capture``: hidden states land byte-exact in the run's captures.

Ground truth: a second, independent forward hook on the same blocks clones their
outputs at the same steps; every captured tensor must equal its clone bit for bit, and
nothing else may be captured.
"""

from __future__ import annotations

import pytest
import torch

from syncless.capture import open as open_captures
from syncless.cli import main
from syncless.demo.capture_tool import CaptureTool
from syncless.demo.config import preset
from syncless.demo.train import run_demo
from syncless.errors import UsageError
from syncless.guard import no_sync
from syncless.run import open as open_run
from syncless.testing import spawn_gloo


class CloneOutputs:
    """The reference: clones each chosen block's output (or its MoE block's input) at
    the capture steps."""

    name = "reference"

    def __init__(self, layers: list[int], every: int, point: str = "hidden") -> None:
        self.layers, self.every, self.point = layers, every, point
        self.seen: dict[tuple[str, int], torch.Tensor] = {}
        self.step = 0

    def attach(self, ctx) -> None:
        for i in self.layers:
            tag = f"layer_{i:02d}/{self.point}"
            block = ctx.model.layers[i]
            if self.point == "hidden":
                block.register_forward_hook(lambda _m, _a, out, t=tag: self._clone(t, out[0]))
            else:
                block.moe.register_forward_pre_hook(lambda _m, a, t=tag: self._clone(t, a[0]))

    def _clone(self, tag: str, x: torch.Tensor) -> None:
        if self.step % self.every == 0 and torch.is_grad_enabled():
            self.seen[(tag, self.step)] = x.detach().clone()

    def step_begin(self, step: int) -> None:
        self.step = step

    def step_end(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


class GuardedCapture(CaptureTool):
    """The demo's capture tool with every hook call, and every bracketed all-to-all,
    under no_sync(): neither may sync."""

    def _capture_fn(self, tag: str):
        inner = super()._capture_fn(tag)

        def guarded(x):
            with no_sync(cpu_as_device=True):
                inner(x)

        return guarded

    def _bracketed(self, comm):
        inner = super()._bracketed(comm)

        def guarded(*args, **kwargs):
            with no_sync(cpu_as_device=True):
                return inner(*args, **kwargs)

        return guarded


@pytest.mark.parametrize("point", ["hidden", "moe_input"])
def test_captured_tensors_equal_an_independent_clone(tmp_path, point):
    cfg = preset("tiny", n_layers=3, steps=5)
    reference = CloneOutputs([0, 2], every=2, point=point)
    tools = [GuardedCapture("0,2", every=2, point=point), reference]
    result = run_demo(cfg, run_dir=tmp_path / "run", quiet=True, tools=tools)
    store = open_captures(result.run_dir)
    got = {
        (tag, step): store.tensor(i)
        for i, (tag, step) in enumerate(
            zip(
                store.index.column("tag").to_pylist(),
                store.index.column("step").to_pylist(),
                strict=True,
            )
        )
    }
    assert (
        set(got)
        == set(reference.seen)
        == {(f"layer_{i:02d}/{point}", s) for i in (0, 2) for s in (0, 2, 4)}
    )
    for key, tensor in got.items():
        want = reference.seen[key]
        assert tensor.dtype == want.dtype and tensor.shape == want.shape
        assert torch.equal(tensor.view(torch.uint8), want.view(torch.uint8)), key


def test_bad_capture_flags(capsys):
    assert main(["demo", "--capture", "0,7"]) == 2
    assert "expected 'all' or a comma list of layer indices in 0..1" in capsys.readouterr().err
    assert main(["demo", "--capture-every", "3"]) == 2
    assert "--capture-every needs --capture LAYERS" in capsys.readouterr().err
    assert main(["demo", "--capture-point", "moe_input"]) == 2
    assert "--capture-point needs --capture LAYERS" in capsys.readouterr().err
    assert main(["demo", "--capture", "0,3"]) == 2  # the tiny preset has 2 layers
    assert "the model has 2 layer(s) (--preset tiny)" in capsys.readouterr().err
    with pytest.raises(UsageError, match="--capture-point 'q': expected one of hidden, moe_input"):
        CaptureTool("0", point="q")


def _windows_worker(rank, world, root):
    cfg = preset("tiny", steps=3, n_layers=2, batch_size=2, seq_len=32, expert_parallel=True)
    run_demo(cfg, run_dir=root, name="cw", quiet=True,
             tools=[GuardedCapture("0,1", every=1, windows=True)])  # fmt: skip


def test_capture_windows_bracket_every_token_all_to_all(tmp_path):
    """Boundaries: one before and one after each critical region. Ground truth from the
    demo's dispatcher: per MoE layer and step, the counts exchange with its dispatch
    (one region) and the combine in the forward, and the two token backward all-to-alls,
    so 3 steps x 2 layers x 4 x 2 = 48 per rank. Step 0 counts them and runs without windows, so its captures go out by
    ordinary batching, or by the flush before the pattern is defined, whichever takes
    them first; from step 1 every capture goes out inside a window (CPU: the copy is
    synchronous, windows always fit)."""
    spawn_gloo(_windows_worker, 2, str(tmp_path / "run"))
    with open_run(tmp_path / "run") as store:
        _, rows = store.query(
            "SELECT rank, name, sum(value) FROM metrics WHERE name IN ("
            "'capture/step/boundary_count', 'capture/step/captured_count', "
            "'capture/step/captured_bytes', 'capture/step/d2h_window_bytes', "
            "'capture/step/d2h_batch_bytes', 'capture/step/d2h_flush_bytes') "
            "GROUP BY 1, 2 ORDER BY 1, 2"
        )
    record = 2 * 32 * 64 * 4  # batch x seq x d_model x fp32
    for rank in (0, 1):
        got = {name.rsplit("/", 1)[1]: value for r, name, value in rows if r == rank}
        got["d2h_batch_bytes"] += got.pop("d2h_flush_bytes")
        assert got == {
            "boundary_count": 48,
            "captured_count": 6,
            "captured_bytes": 6 * record,
            "d2h_window_bytes": 4 * record,  # steps 1 and 2, 2 layers
            "d2h_batch_bytes": 2 * record,  # step 0, batched or flushed
        }
    store = open_captures(tmp_path / "run")
    assert sorted(store.index.column("rank").to_pylist()) == [0] * 6 + [1] * 6


def test_capture_windows_needs_expert_parallel(tmp_path, capsys):
    argv = ["demo", "--steps", "1", "--capture", "0", "--capture-windows", "--run-dir"]
    assert main([*argv, str(tmp_path / "run")]) == 2
    assert "--capture-windows brackets the expert-parallel all-to-alls" in capsys.readouterr().err
    assert main(["demo", "--capture-windows"]) == 2
    assert "--capture-windows needs --capture LAYERS" in capsys.readouterr().err
