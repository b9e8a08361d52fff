"""examples/megatron_gpt.py runs (one gloo rank on the CPU, through the test shim) and
leaves every layer's monitor records and its captures in the run directory."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from integration_helpers import load_example
from megatron_harness import cuda_to_cpu, single_process

from syncless.capture import open as syncless_capture_open
from syncless.run import open as open_run


def test_the_megatron_example_records_every_layer_and_its_captures(tmp_path):
    example = load_example("megatron_gpt")
    run_dir = tmp_path / "run"
    argv = ["--layers", "2", "--hidden", "64", "--seq", "16", "--steps", "4",
            "--micro-batches", "2", "--validate-every", "2", "--run-dir", str(run_dir)]  # fmt: skip
    with single_process(), cuda_to_cpu():
        syncless = example.main(argv, device=torch.device("cpu"))
    assert (syncless.iterations, syncless.validations) == (4, 2)
    assert syncless.handle.optimizer_steps == 4
    with open_run(run_dir) as store:
        _, rows = store.query(
            "SELECT DISTINCT split_part(name, '/', 2) FROM metrics "
            "WHERE name LIKE 'monitors/layer_%/act_absmax' ORDER BY 1"
        )
    assert [r[0] for r in rows] == ["layer_00", "layer_01"]
    # one capture per micro-batch: 4 steps and 2 validations of 2 micro-batches
    captures = syncless_capture_open(run_dir)
    assert len(captures) == (4 + 2) * 2
    assert set(captures.tags()) == {"stage_output"}
