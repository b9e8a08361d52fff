"""bench/stacks/cuda_graphs.py's CPU smoke run (``--smoke``): the GPU bench's whole flow, eager
and graphed steps, the stack and the alarm each captured in a graph of its own, with
syncless.graphs.StandInGraph in place of CUDA graphs, tiny shapes, nothing appended."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# One case per model family at its launch-bound shape (the GPU-bound ones differ only in
# batch); the dense torchtitan and Hugging Face models and the MoE one.
CASES = ["torchtitan-llama3:B1xL32", "llama-1b:B1xL64", "torchtitan-moe:B1xL32"]
STACK_METRICS = {  # a name each monitor of the stack records
    "attention": "monitors/global/attn_qk_logit_max",
    "activations": "monitors/global/act_absmax",
    "norms": "monitors/global/grad_norm",
    "nonfinite": "monitors/step/loss_nonfinite_count",
}


@pytest.mark.slow
def test_cuda_graphs_smoke_measures_every_phase_inside_stand_in_graphs(tmp_path):
    pytest.importorskip("torchtitan")
    pytest.importorskip("transformers")
    results = (ROOT / "bench" / "RESULTS.md").read_bytes()
    report = tmp_path / "cuda_graphs.json"
    argv = [sys.executable, "-m", "bench.stacks", "cuda_graphs", "--smoke"]
    argv += ["--cases", ",".join(CASES), "--json", str(report)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}  # fmt: skip
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    models = json.loads(report.read_text())["models"]
    assert list(models) == CASES, done.stdout[-2000:] + done.stderr[-4000:]
    for key, entry in models.items():
        assert entry["backend"] == "stand-in"
        assert not entry["failed"] and not entry["skipped"], (key, entry["failed"])
        assert set(entry["phases"]) == {"graphs", "stack", "alarm"}
        stack, alarm = entry["phases"]["stack"], entry["phases"]["alarm"]
        assert stack["errors"] == {} and alarm["errors"] == {}, key
        names = set(stack["metric_names"])
        expected = dict(STACK_METRICS)
        if "moe" in key:
            expected["moe"] = "monitors/global/moe_imbalance_max"
        missing = {m: n for m, n in expected.items() if n not in names}
        assert not missing, (key, missing, sorted(names))
        assert "monitors/step/loss_nonfinite_count" in alarm["metric_names"], key
        assert not any("attn_" in n for n in alarm["metric_names"])  # the alarm alone
        line = entry["line"]
        assert "CUDA graph: stack " in line and "; alarm " in line and "; graphs buy " in line
    assert (ROOT / "bench" / "RESULTS.md").read_bytes() == results  # --smoke appends nothing
