"""``syncless report RUN_A RUN_B`` (issue #48): runs the test writes, overlaid; every
line, band and heatmap cell checked against numpy over the written values."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from plotly_figures import array
from written_runs import unrelated_run, write_records

from syncless.errors import UsageError
from syncless.report import overlay

STEPS, RANKS, LAYERS = 50, 2, 3


def value(run: int, rank: int, step: int) -> float:
    return 5.0 - 0.05 * step + 0.1 * run + 0.01 * rank


def act(run: int, layer: int, step: int) -> float:
    return 1.0 + layer + 0.01 * step + (2.0 if (run, layer) == (1, 2) and step >= 20 else 0.0)


def write(path: Path, run: int, extra: str | None = None) -> Path:
    records: dict[tuple[int, int, str], float] = {}
    for rank in range(RANKS):
        for step in range(STEPS):
            records[step, rank, "demo/step/loss"] = value(run, rank, step)
            if extra:
                records[step, rank, extra] = 1.0
            if rank == 0 and step % (2 + run) == 0:  # monitors at each run's own cadence
                for layer in range(LAYERS):
                    records[step, 0, f"monitors/layer_{layer:02d}/act_absmax"] = act(
                        run, layer, step
                    )
    info = {
        "name": path.name,
        "world_size": RANKS,
        "config": {"lr": 0.1 * (run + 1), "layers": LAYERS},
    }
    return write_records(path, records, info)


def figures(page: str) -> dict[str, tuple[list[dict], dict]]:
    """title -> (traces, layout) of every figure on the page."""
    out = {}
    for match in re.finditer(r'Plotly\.newPlot\(\s*"fig-[^"]+",\s*', page):
        decoder = json.JSONDecoder()
        traces, end = decoder.raw_decode(page, match.end())
        layout, _ = decoder.raw_decode(page, page.index("{", end))
        title = layout.get("title", {})
        out[title.get("text", "") if isinstance(title, dict) else title] = (traces, layout)
    return out


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("overlay")
    runs = [write(root / "a", 0, extra="demo/step/only_a"), write(root / "b", 1)]
    return overlay.build([str(r) for r in runs])


def test_a_chart_per_shared_metric_with_each_runs_line_and_band(page):
    charts = figures(page)
    assert "demo/step/loss" in charts and "demo/step/only_a" not in charts  # not shared
    traces, _ = charts["demo/step/loss"]
    lines = {t["name"]: t for t in traces if t.get("name")}
    assert sorted(lines) == ["a", "b"]
    for run, name in enumerate(("a", "b")):
        mean = [np.mean([value(run, r, s) for r in range(RANKS)]) for s in range(STEPS)]
        np.testing.assert_allclose(array(lines[name]["y"]), mean, rtol=1e-6)
        band = [t for t in traces if t.get("legendgroup") == name and not t.get("name")]
        low, high = (array(t["y"]) for t in band)  # the ranks differ: the band has a width
        np.testing.assert_allclose(low, [value(run, 0, s) for s in range(STEPS)], rtol=1e-6)
        np.testing.assert_allclose(high, [value(run, 1, s) for s in range(STEPS)], rtol=1e-6)


def test_heatmaps_side_by_side_and_as_a_difference_from_the_first_run(page):
    traces, layout = figures(page)["act_absmax"]
    assert [t["coloraxis"] for t in traces] == ["coloraxis", "coloraxis"]
    a, b = (array(t["z"]) for t in traces)
    steps = array(traces[0]["x"]).astype(int)
    assert steps.tolist() == sorted({s for s in range(STEPS) if s % 2 == 0 or s % 3 == 0})
    want_a = [[act(0, lay, s) if s % 2 == 0 else np.nan for s in steps] for lay in range(LAYERS)]
    np.testing.assert_allclose(a, want_a, rtol=1e-6)
    # The difference: each run's last reading held until its next, minus the first run's.
    (switch,) = layout["updatemenus"]
    values, difference = (b["args"][0] for b in switch["buttons"])
    assert difference["coloraxis"] == ["coloraxis", "coloraxis2"]
    diff = np.array(difference["z"][1], dtype=float)
    for lay in range(LAYERS):
        for col, s in enumerate(steps):
            held_a, held_b = s - s % 2, s - s % 3  # the latest reading at or before s
            if held_b > 48:  # past b's last reading: nothing held
                assert np.isnan(diff[lay, col])
                continue
            want = act(1, lay, held_b) - act(0, lay, held_a)
            assert diff[lay, col] == pytest.approx(want, rel=1e-3, abs=1e-3), (lay, s)
    assert np.array(values["z"][1], dtype=float).shape == b.shape


def test_the_callout_names_the_largest_difference(page):
    callout = re.search(r'id="worst-overlay-act_absmax">([^<]*)<', page).group(1)
    assert "highest: b, layer 2 at step 48 (5.48)" in callout
    steps = [s for s in range(49) if s % 2 == 0 or s % 3 == 0]
    gaps = {s: act(1, 2, s - s % 3) - act(0, 2, s - s % 2) for s in steps}
    step = max(gaps, key=lambda s: abs(gaps[s]))
    assert f"largest difference from a: b, layer 2 at step {step} ({gaps[step]:+.4g})" in callout


def test_the_configs_are_diffed(page):
    table = page[page.index("key(s) differ") :]
    assert "1 key(s) differ, 2 the same" in page  # lr; world_size and layers agree
    assert ">lr<" in table and ">0.1<" in table and ">0.2<" in table


def test_the_page_is_written_to_the_working_directory_by_default(tmp_path):
    runs = [str(write(tmp_path / "x", 0)), str(write(tmp_path / "y", 1))]
    done = subprocess.run([sys.executable, "-m", "syncless.cli", "report", *runs],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {overlay.DEFAULT_OUTPUT} (")
    assert (tmp_path / overlay.DEFAULT_OUTPUT).stat().st_size > 1e6  # plotly inlined


def test_a_folder_with_one_run_gets_that_runs_report(tmp_path):
    write(tmp_path / "runs" / "only", 0)
    assert "syncless report: only<" in overlay.build([str(tmp_path / "runs")])


def test_runs_with_nothing_in_common_are_refused(tmp_path):
    a = write(tmp_path / "a", 0)
    b = unrelated_run(tmp_path / "b")
    with pytest.raises(UsageError, match="no metric in common"):
        overlay.build([str(a), str(b)])
