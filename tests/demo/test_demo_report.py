"""`syncless demo` ends with RUN_DIR/report.html, the page a newcomer opens first."""

import sys

import numpy as np
import pytest
from plotly_figures import array, figure_data

import syncless.report
from syncless.cli import main
from syncless.run import open as open_run


def _demo(tmp_path, *argv):
    return main(["demo", "--steps", "3", "--run-dir", str(tmp_path / "run"), *argv])


def test_the_demo_writes_its_report_and_says_where(tmp_path, capsys):
    assert _demo(tmp_path) == 0
    page = tmp_path / "run" / "report.html"
    assert f"report: {page}" in capsys.readouterr().err
    with open_run(tmp_path / "run") as store:
        _, rows = store.query(
            "SELECT step, value FROM metrics WHERE name = 'demo/step/loss' ORDER BY step"
        )
    curves = figure_data(page.read_text(), "curves")
    loss = next(t for t in curves if t.get("name") == "demo/step/loss")
    assert array(loss["x"]).tolist() == [step for step, _ in rows]
    assert array(loss["y"]) == pytest.approx(np.array([v for _, v in rows]))


def test_no_report_writes_none(tmp_path):
    assert _demo(tmp_path, "--no-report", "--quiet") == 0
    assert not (tmp_path / "run" / "report.html").exists()


def test_without_the_report_extra_the_demo_says_how_to_get_one(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "syncless.report.html", None)  # import fails
    monkeypatch.delattr(syncless.report, "html", raising=False)
    assert _demo(tmp_path) == 0
    assert 'pip install "syncless[report]"' in capsys.readouterr().err
    assert not (tmp_path / "run" / "report.html").exists()
    assert (tmp_path / "run" / "run.json").exists()  # the run itself is whole
