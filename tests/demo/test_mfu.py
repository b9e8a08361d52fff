"""MFU: the FLOPs-per-token formula against torch's own FLOP count, the peak table, and
MFU where a user reads it (progress line, run.json, `syncless summary`, the report)."""

import io
import json

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from syncless.cli import main
from syncless.demo.config import preset
from syncless.demo.flops import active_matmul_params, flops_per_token, peak_for
from syncless.demo.model import MoETransformer, init_weights
from syncless.demo.progress import ProgressLines
from syncless.demo.steplog import Throughput
from syncless.run import Run, StepRecord


@pytest.mark.parametrize(
    "overrides",
    [{}, {"n_layers": 3, "shared_expert": False, "n_experts": 6, "top_k": 3, "seq_len": 48}],
)
def test_flops_per_token_is_what_torch_counts_in_a_training_step(overrides):
    # Ground truth: torch's FlopCounterMode over one forward and backward, with the
    # experts as plain matmuls (loop) and attention as explicit matmuls (math SDPA):
    # every matmul the step runs, the causal half of attention included.
    cfg = preset("tiny", expert_impl="loop", **overrides)
    model = MoETransformer(cfg)
    init_weights(model, seed=0)
    tokens = torch.randint(0, 256, (2, cfg.seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits, balance = model(tokens)
        (F.cross_entropy(logits.flatten(0, 1), tokens.flatten()) + balance).backward()
    assert flops_per_token(cfg) * tokens.numel() == counter.get_total_flops()


def test_active_parameters_by_hand_for_the_tiny_preset():
    # 2 layers x (attention 4 x 64^2 + router 64 x 4 + 2 experts and the shared one,
    # 3 x 64 x 128 each) + the tied head 256 x 64.
    per_layer = 4 * 64 * 64 + 64 * 4 + 3 * (3 * 64 * 128)
    assert active_matmul_params(preset("tiny")) == 2 * per_layer + 256 * 64
    assert flops_per_token(preset("tiny")) == 6 * (2 * per_layer + 256 * 64) + 12 * 2 * 64 * 64


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H20", 148e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA B200", 2.25e15),
        ("NVIDIA GB200", 2.5e15),
    ],
)
def test_the_peak_table_knows_the_datacenter_gpus(name, peak):
    assert peak_for("cuda", name, bf16=True).flops == peak


def test_no_mfu_without_a_known_bf16_peak():
    for peak, reason in [
        (peak_for("cpu", "", bf16=False), "CPU"),
        (peak_for("cuda", "NVIDIA H200", bf16=False), "fp32"),
        (peak_for("cuda", "NVIDIA GeForce RTX 4090", bf16=True), "unknown GPU"),
    ]:
        assert peak.flops is None and reason in peak.about


def test_throughput_turns_a_step_time_into_tokens_and_mfu():
    h200 = peak_for("cuda", "NVIDIA H200", bf16=True)
    two_gpus = Throughput(tokens_per_step=20_000, flops_per_token=4_000_000_000, peak=h200,
                          gpus=2)  # fmt: skip
    m = two_gpus.metrics(0.25)
    assert m["demo/step/tokens_per_s"] == 80_000
    assert m["demo/step/mfu_frac"] == pytest.approx(80_000 * 4e9 / 2 / 989e12)
    # Two ranks sharing one GPU: the GPU does both ranks' work.
    shared = Throughput(20_000, 4_000_000_000, h200, gpus=1).metrics(0.25)
    assert shared["demo/step/mfu_frac"] == pytest.approx(80_000 * 4e9 / 989e12)
    cpu = Throughput(1000, 10, peak_for("cpu", "", False), 0).metrics(0.5)
    assert "demo/step/mfu_frac" not in cpu and cpu["demo/step/step_ms"] == 500


def test_the_progress_line_shows_mfu():
    out = io.StringIO()
    lines = ProgressLines(10, "syncless demo (cuda, 1 rank(s), peak 989 TFLOP/s bf16)",
                          Console(file=out))  # fmt: skip
    values = {"demo/step/loss": 2.0, "demo/step/tokens_per_s": 97_000.0,
              "demo/step/mfu_frac": 0.3625, "demo/step/step_ms": 250.0}  # fmt: skip
    lines.write([StepRecord("r", 0, 0, k, v, 0.0) for k, v in values.items()])
    line = out.getvalue()
    assert "peak 989 TFLOP/s bf16): step 0" in line
    assert "tokens/s 97,000  MFU 36.2%  step ms 250.0" in line


def test_run_json_records_the_flops_per_token_and_why_there_is_no_mfu(tmp_path):
    assert main(["demo", "--steps", "2", "--run-dir", str(tmp_path / "r"), "--quiet",
                 "--no-report"]) == 0  # fmt: skip
    config = json.loads((tmp_path / "r" / "run.json").read_text())["config"]
    assert config["flops_per_token"] == flops_per_token(preset("tiny"))
    assert config["peak_flops"] is None and "CPU" in config["peak_flops_about"]
    assert config["expert_impl_used"] == "grouped" and config["expert_impl"] == "auto"


def _gpu_like_run(run_dir):
    config = {"flops_per_token": 4_031_000_000, "peak_flops": 989e12,
              "peak_flops_about": "NVIDIA H200, bf16 dense"}  # fmt: skip
    with Run(name="gpu", config=config, run_dir=run_dir) as run:
        for step, mfu in enumerate((0.34, 0.36, 0.38)):
            run.log(step, {"demo/step/tokens_per_s": 90_000.0 + step,
                           "demo/step/mfu_frac": mfu, "demo/step/loss": 1.0})  # fmt: skip


def test_summary_and_report_show_mfu_and_its_peak(tmp_path, capsys):
    _gpu_like_run(tmp_path / "run")
    assert main(["summary", str(tmp_path / "run")]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the table may wrap
    assert (
        "MFU 36.0% (mean) of 989 TFLOP/s per device (NVIDIA H200, bf16 dense); 4.031 GFLOP per token"
        in out
    )
    from syncless.report import html

    page = html.write(tmp_path / "run").read_text()
    assert "36.0% (mean, demo/step/mfu_frac) of 989 TFLOP/s per device" in page


def test_a_cpu_run_says_why_it_has_no_mfu(tmp_path, capsys):
    assert main(["demo", "--steps", "2", "--run-dir", str(tmp_path / "r"), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["summary", str(tmp_path / "r")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "MFU not measured: a CPU has no tensor-core peak to compare with" in out
    assert "not measured: a CPU" in (tmp_path / "r" / "report.html").read_text()
