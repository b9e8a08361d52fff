"""The HTML report against synthetic run directories whose every value the test knows."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from plotly_figures import array, figure_data

from syncless.report import html as report
from syncless.run import ParquetSink, StepRecord
from syncless.run.rundir import METRICS_DIR, write_run_json

LAYERS, HEADS, EXPERTS, STEPS = 3, 4, 4, 6


def logit(rank: int, layer: int, step: int) -> float:
    """Known per-layer values; the spike at layer 1, step 3 on rank 1 is the worst."""
    spike = 9.0 if (rank, layer, step) == (1, 1, 3) else 0.0
    return 1.0 + 0.1 * layer + 0.01 * step + 0.001 * rank + spike


def grad_rms(rank: int, layer: int, step: int) -> float:
    """Output-gradient RMS: rank 0's layer 2 grows from step 4 on (its worst cell)."""
    return 0.5 + 0.01 * layer + 0.001 * rank + (3.0 if (rank, layer) == (0, 2) and step >= 4 else 0)


def records(rank: int, steps: range) -> list[StepRecord]:
    out = []

    def add(step: int, name: str, value: float) -> None:
        out.append(StepRecord("test", step, rank, name, value, 1000.0 + step))

    for step in steps:
        add(step, "demo/step/loss", 5.0 - 0.1 * step)
        add(step, "demo/step/step_ms", 100.0)
        add(step, "profile/step/time_ms", 100.0)
        add(step, "profile/forward/time_ms", 60.0)
        add(step, "profile/attention/time_ms", 30.0)  # nested in forward
        add(step, "profile/backward/time_ms", 35.0 + 10 * rank)
        add(step, "profile/all_reduce/rendezvous_ms", 2.0)
        add(step, "profile/all_reduce/late_rank", 1.0)
        add(step, "dataplane/step/get/wall_ms", 3.0)
        add(step, "dataplane/step/get/mb", 0.5)
        add(step, "dataplane/step/put/wall_ms", 1.0)
        add(step, "monitors/self/hook_host_ms", 0.5)
        for layer in range(LAYERS):
            add(step, f"monitors/layer_{layer:02d}/attn_qk_logit_max", logit(rank, layer, step))
            add(step, f"monitors/layer_{layer:02d}/grad_out_rms", grad_rms(rank, layer, step))
            for head in range(HEADS):  # head 3 of layer 0 is worst at the last step
                worst = 7.0 if (layer, head, step) == (0, 3, steps[-1]) else 0.0
                add(
                    step,
                    f"monitors/layer_{layer:02d}/attn_qk_logit_max/head_{head}",
                    head * 0.1 + worst,
                )
            for expert in range(EXPERTS):  # expert 1 of layer 2 is the busiest
                tokens = 400.0 if (layer, expert) == (2, 1) else 100.0
                add(step, f"monitors/layer_{layer:02d}/moe_tokens_count/expert_{expert}", tokens)
    return out


def make_run(path: Path, ranks: int = 1, steps: range = range(STEPS)) -> Path:
    path.mkdir(parents=True)
    write_run_json(path, {"name": path.name, "world_size": ranks, "config": {"lr": 0.1}})
    for rank in range(ranks):
        sink = ParquetSink(path / METRICS_DIR, rank, flush_interval_s=3600)
        sink.write(records(rank, steps))
        sink.close()
    return path


def worst_text(page: str, anchor: str) -> str:
    match = re.search(r'id="worst-' + re.escape(anchor) + r'">([^<]*)<', page)
    assert match, f"no callout worst-{anchor}"
    return match.group(1)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> str:
    run_dir = make_run(tmp_path_factory.mktemp("report") / "two", ranks=2)
    return report.build(run_dir)


def test_the_page_loads_nothing_from_the_network(two_ranks):
    # plotly.js holds link strings (map attributions) inside its script text: those
    # are never fetched. What the browser would load is in the markup outside scripts.
    assert two_ranks.count("<script") == two_ranks.count("Plotly.newPlot(") + 1
    markup = re.sub(r"<script[^>]*>.*?</script>", "", two_ranks, flags=re.S)
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", markup, re.I)
    assert not re.search(r"<script[^>]*\ssrc=", two_ranks)
    assert not re.search(r"<link\b", markup)


def test_layer_heatmap_holds_the_worst_rank_per_layer_and_step(two_ranks):
    (trace,) = figure_data(two_ranks, "layers-attn_qk_logit_max")
    expected = np.array(
        [[max(logit(r, layer, s) for r in (0, 1)) for s in range(STEPS)] for layer in range(LAYERS)]
    )
    np.testing.assert_allclose(array(trace["z"]), expected)
    assert list(array(trace["x"])) == list(range(STEPS))
    assert list(array(trace["y"])) == list(range(LAYERS))
    assert worst_text(two_ranks, "layers-attn_qk_logit_max").startswith(
        "highest: layer 1 at step 3 (10.13)"
    )


def test_gradient_and_activation_moments_have_heatmaps(two_ranks):
    (trace,) = figure_data(two_ranks, "layers-grad_out_rms")
    expected = [[max(grad_rms(r, layer, s) for r in (0, 1)) for s in range(STEPS)]
                for layer in range(LAYERS)]  # fmt: skip
    np.testing.assert_allclose(array(trace["z"]), np.array(expected))
    assert worst_text(two_ranks, "layers-grad_out_rms").startswith("highest: layer 2 at step 4")
    assert "layers-act_kurtosis" not in two_ranks  # not recorded: no empty map


def test_every_heatmap_metric_is_read():
    from syncless.report.data import LAYER_METRICS
    from syncless.report.sections_layers import HEATMAPS

    assert sorted(LAYER_METRICS) == sorted(h.metric for h in HEATMAPS)


def test_head_and_expert_grids_name_the_worst_one(two_ranks):
    (trace,) = figure_data(two_ranks, "heads-attn_qk_logit_max")
    z = array(trace["z"])
    assert z.shape == (HEADS, LAYERS) and z[3, 0] == pytest.approx(7.3)
    assert worst_text(two_ranks, "heads-attn_qk_logit_max") == "highest: layer 0 head 3 (7.3)"
    text = worst_text(two_ranks, "experts-moe_tokens_count")
    assert text.startswith("highest: layer 2 expert 1 (400), 2.29x its layer's mean")  # 400 / 175


def test_step_time_dataplane_and_late_rank_sections(two_ranks):
    stacked = [t["name"] for t in figure_data(two_ranks, "profile-sections") if t["type"] == "bar"]
    assert stacked == ["forward", "backward"]  # attention is nested: it does not fit
    assert worst_text(two_ranks, "dataplane") == "most time: get (3% of step time)"
    # rank 1's backward is 10 ms slower than rank 0's: the culprit of the late rank 1
    assert re.search(
        r"<td>all_reduce</td><td class=\"n\">1</td><td>backward</td><td class=\"n\">10</td>",
        two_ranks,
    )
    assert "What syncless cost" in two_ranks and "monitors/self/hook_host_ms" in two_ranks


# As in the demo: experts (nested in forward) is larger than optimizer and data, and the
# top-level sections fill the step. Name: (ms per step, depth, order); all_reduce is a
# collective directly inside the step.
DEMO_LIKE = {"data": (4.0, 0, 1), "forward": (30.0, 0, 2), "experts": (20.0, 1, 3),
             "backward": (45.0, 0, 4), "all_reduce": (5.0, 0, 5), "optimizer": (15.0, 0, 6),
             "log": (1.0, 0, 7)}  # fmt: skip


def nested_run(path: Path, recorded: bool) -> Path:
    """Steps 0..5 of one rank; ``recorded``: with the profiler's depth and order records."""
    path.mkdir(parents=True)
    write_run_json(path, {"name": path.name, "world_size": 1})
    out = []
    for step in range(STEPS):
        rows = {"profile/step/time_ms": 100.0, "profile/all_reduce/rendezvous_ms": 2.0,
                "profile/all_reduce/transfer_ms": 3.0}  # fmt: skip
        nesting = {"step": (0, 0)} | {n: (d, o) for n, (_, d, o) in DEMO_LIKE.items()}
        rows |= {f"profile/{n}/time_ms": ms for n, (ms, _, _) in DEMO_LIKE.items()}
        if recorded:
            for name, (depth, order) in nesting.items():
                rows[f"profile/{name}/depth_count"] = float(depth)
                rows[f"profile/{name}/order_count"] = float(order)
        out += [StepRecord("t", step, 0, n, v, 1000.0 + step) for n, v in rows.items()]
    sink = ParquetSink(path / METRICS_DIR, 0, flush_interval_s=3600)
    sink.write(out)
    sink.close()
    return path


def test_the_stacked_chart_holds_exactly_the_recorded_top_level_sections(tmp_path):
    page = report.build(nested_run(tmp_path / "recorded", recorded=True))
    bars = {t["name"]: t for t in figure_data(page, "profile-sections") if t["type"] == "bar"}
    assert list(bars) == ["backward", "forward", "optimizer", "all_reduce", "data", "log"]
    np.testing.assert_allclose(sum(array(t["y"]) for t in bars.values()), [100.0] * STEPS)
    assert "<td>experts</td>" in page  # in the table, not in the chart
    # A run recorded before the nesting records: the fallback guess stacks experts and
    # leaves optimizer out (the error the records fix).
    page = report.build(nested_run(tmp_path / "older", recorded=False))
    bars = [t["name"] for t in figure_data(page, "profile-sections") if t["type"] == "bar"]
    assert bars == ["backward", "forward", "experts", "data", "log"]


def test_sections_the_run_lacks_are_absent(tmp_path):
    run_dir = tmp_path / "bare"
    run_dir.mkdir()
    write_run_json(run_dir, {"name": "bare", "world_size": 1})
    sink = ParquetSink(run_dir / METRICS_DIR, 0, flush_interval_s=3600)
    sink.write(
        [StepRecord("t", s, 0, "demo/step/loss", 1.0 / (s + 1), 1000.0 + s) for s in range(4)]
    )
    sink.close()
    page = report.build(run_dir)
    assert 'id="run"' in page and 'id="curves"' in page
    for absent in ("attention", "experts", "step-time", "dataplane", "captures", "self-cost"):
        assert f'id="{absent}"' not in page
    (trace,) = figure_data(page, "curves")
    np.testing.assert_allclose(array(trace["y"]), [1.0, 0.5, 1 / 3, 0.25])


def test_a_truncated_shard_is_skipped_with_a_warning(tmp_path, caplog):
    run_dir = make_run(tmp_path / "killed", ranks=2)
    shard = sorted((run_dir / METRICS_DIR).glob("rank00001-*.parquet"))[0]
    with shard.open("r+b") as f:  # as a killed writer or a full disk leaves it
        f.truncate(shard.stat().st_size // 2)
    with caplog.at_level(logging.WARNING):
        page = report.build(run_dir)
    assert shard.name in caplog.text
    assert 'class="warn"' in page and shard.name in page
    assert "1 rank(s) wrote no readable shard" in page
    (trace,) = figure_data(page, "layers-attn_qk_logit_max")
    expected = [[logit(0, layer, s) for s in range(STEPS)] for layer in range(LAYERS)]
    np.testing.assert_allclose(array(trace["z"]), expected)


def test_the_command_writes_report_html_in_the_run_dir(tmp_path):
    from syncless.cli import main

    run_dir = make_run(tmp_path / "cmd")
    assert main(["report", str(run_dir)]) == 0
    assert (run_dir / "report.html").stat().st_size > 1_000_000  # plotly.js is inside


def chromium() -> str | None:
    return next(
        (b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
    )


def test_every_chart_renders_in_a_headless_browser(tmp_path):
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium on PATH: apt-get install chromium to run the browser test")
    run_dir = make_run(tmp_path / "browser", ranks=2)
    path = report.write(run_dir)
    # With --enable-logging=stderr every console message and uncaught exception is a
    # ":CONSOLE:" line on stderr; the page writes none when it works.
    argv = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr",
            "--virtual-time-budget=10000", "--dump-dom", path.as_uri()]  # fmt: skip
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    charts = re.findall(r'<div id="(fig-[^"]+)" class="[^"]*plotly-graph-div', p.stdout)
    assert len(charts) == report.build(run_dir).count("Plotly.newPlot(") >= 8
    for chart in charts:  # each chart div got its SVG
        start = p.stdout.index(f'id="{chart}"')
        assert 'class="main-svg"' in p.stdout[start : start + 5000], chart
    errors = [line for line in p.stderr.splitlines() if ":CONSOLE" in line]
    assert not errors, errors
