"""The first NaN/Inf heads the summary and the report. Runs are written with ``Run.log``
as the monitors' readouts write them; the expected step and layer are computed here
from those records, not by the query under test."""

from __future__ import annotations

import html
import io
import re
from pathlib import Path

import pytest

from syncless.report import html as report
from syncless.report.summary import print_summary, read
from syncless.run import Run
from syncless.run.dist import RankInfo

# rank -> step -> name -> value
Records = dict[int, dict[int, dict[str, float]]]

LAYERS, STEPS = 4, 16
OUTPUT_READOUTS = (4, 9, 14)  # the nonfinite monitor's (lagged) readouts
NORM_READOUTS = (0, 5, 10, 15)  # the norms monitor's


def clean() -> Records:
    """Two ranks, every readout finite: counts of zero, no first-step records."""
    out: Records = {}
    for rank in (0, 1):
        out[rank] = {s: {"demo/step/loss": 3.0 - 0.1 * s} for s in range(STEPS)}
        for step in OUTPUT_READOUTS:
            for layer in range(LAYERS):
                out[rank][step][f"monitors/layer_{layer:02d}/nonfinite_count"] = 0.0
            out[rank][step]["monitors/global/nonfinite_count"] = 0.0
        for step in NORM_READOUTS:
            out[rank][step]["monitors/step/grad_nonfinite_layers_count"] = 0.0
    return out


def readout(records: Records, rank: int, step: int, counts: dict[int, float]) -> None:
    """Per-layer nonfinite counts of one readout, and their global sum."""
    for layer, count in counts.items():
        records[rank][step][f"monitors/layer_{layer:02d}/nonfinite_count"] = count
    records[rank][step]["monitors/global/nonfinite_count"] = sum(counts.values())


def diverged() -> Records:
    """Layer 3 goes nonfinite at step 7 (readout 9), layer 0 at step 12 (readout 14)."""
    out = clean()
    readout(out, 0, 9, {3: 4.0, 2: 2.0})  # layer 2 follows at step 8
    readout(out, 1, 9, {3: 1.0})  # rank 1's own outputs: the readout's count is both ranks'
    readout(out, 0, 14, {0: 3.0, 3: 5.0})
    for rank in (0, 1):  # cluster-wide: rank 0 writes them, a second copy must not matter
        out[rank][9] |= {
            "monitors/step/nonfinite_first_step": 7.0,
            "monitors/step/nonfinite_first_layer": 3.0,
        }
    out[0][14] |= {
        "monitors/step/nonfinite_first_step": 12.0,
        "monitors/step/nonfinite_first_layer": 0.0,
        "monitors/step/loss_nonfinite_count": 2.0,
        "monitors/step/loss_nonfinite_first_step": 11.0,
        "monitors/step/grad_norm_nonfinite_count": 1.0,
        "monitors/step/grad_norm_nonfinite_first_step": 13.0,
    }
    out[0][10] |= {
        "monitors/step/grad_nonfinite_layers_count": 2.0,
        "monitors/step/grad_nonfinite_first_layer": 1.0,
    }
    out[0][15] |= {
        "monitors/step/grad_nonfinite_layers_count": 4.0,
        "monitors/step/grad_nonfinite_first_layer": 0.0,
    }
    return out


def loss_only() -> Records:
    out = clean()
    out[0][9] |= {
        "monitors/step/loss_nonfinite_count": 1.0,
        "monitors/step/loss_nonfinite_first_step": 6.0,
    }
    return out


def write(run_dir: Path, records: Records) -> Path:
    for rank, steps in sorted(records.items()):  # rank 0 first: it claims the directory
        ranks = RankInfo(rank=rank, world_size=len(records), local_rank=rank)
        with Run(name="nonfinite", run_dir=run_dir, ranks=ranks) as run:
            for step, values in sorted(steps.items()):
                run.log(step, values)
    return run_dir


def earliest(records: Records, name: str, by_value: bool = True) -> tuple[int, float] | None:
    """(record step, value) of the record of ``name`` with the lowest value (or step)."""
    found = [(s, v[name]) for steps in records.values() for s, v in steps.items() if name in v]
    return min(found, key=lambda f: f[1] if by_value else f[0], default=None)


def summary(run_dir: Path) -> list[str]:
    out = io.StringIO()
    print_summary(read(run_dir), out)
    return out.getvalue().splitlines()


def banner(page: str) -> list[str] | None:
    """The sentences of the alarm box, or None without one."""
    box = re.search(r'<div class="alarm" id="nonfinite"[^>]*>(.*?)</div>', page, re.S)
    return [html.unescape(p) for p in re.findall(r"<p>(.*?)</p>", box[1])] if box else None


@pytest.fixture(scope="module")
def nonfinite_run(tmp_path_factory) -> tuple[Path, Records]:
    records = diverged()
    return write(tmp_path_factory.mktemp("nonfinite") / "run", records), records


def test_the_first_nonfinite_step_and_layer_head_the_summary(nonfinite_run) -> None:
    run_dir, records = nonfinite_run
    readout_step, first = earliest(records, "monitors/step/nonfinite_first_step")
    layer = records[0][readout_step]["monitors/step/nonfinite_first_layer"]
    values = sum(r[readout_step]["monitors/global/nonfinite_count"] for r in records.values())
    assert (first, layer, values) == (7, 3, 7)  # the fixture is what the test means
    _, loss = earliest(records, "monitors/step/loss_nonfinite_first_step")
    _, grad_norm = earliest(records, "monitors/step/grad_norm_nonfinite_first_step")
    grad_step, grad_layer = earliest(
        records, "monitors/step/grad_nonfinite_first_layer", by_value=False
    )
    grad_layers = records[0][grad_step]["monitors/step/grad_nonfinite_layers_count"]
    expected = [
        f"First nonfinite value: step {first:.0f}, layer {layer:.0f} output "
        f"({values:.0f} values in that readout)",
        f"First nonfinite loss: step {loss:.0f}",
        f"First nonfinite total gradient norm: step {grad_norm:.0f}",
        f"First nonfinite layer gradient norm: step {grad_step}, layer {grad_layer:.0f} "
        f"({grad_layers:.0f} layers nonfinite at that step)",
    ]
    lines = summary(run_dir)
    assert lines[: len(expected) + 1] == [*expected, ""]
    assert lines[len(expected) + 1].strip() == "run"  # then the summary as before
    assert banner(report.build(run_dir)) == expected


def test_the_banner_is_the_first_thing_on_the_page(nonfinite_run) -> None:
    run_dir, _ = nonfinite_run
    page = report.build(run_dir)
    body = page[page.index("<body>") :]
    assert body.index('id="nonfinite"') < body.index("<nav>") < body.index('id="run"')


def test_a_run_with_only_a_nonfinite_loss_shows_the_loss_alone(tmp_path) -> None:
    records = loss_only()
    run_dir = write(tmp_path / "run", records)
    _, loss = earliest(records, "monitors/step/loss_nonfinite_first_step")
    expected = [f"First nonfinite loss: step {loss:.0f}"]
    assert summary(run_dir)[:2] == [*expected, ""]
    assert banner(report.build(run_dir)) == expected


def test_a_clean_run_shows_no_banner(tmp_path) -> None:
    run_dir = write(tmp_path / "run", clean())
    assert "nonfinite" not in "\n".join(summary(run_dir)).lower()
    page = report.build(run_dir)
    assert banner(page) is None and 'class="alarm"' not in page


def spiked() -> Records:
    """The gradient norm spikes at step 10 (readout 10), where layer 2 moved first at
    step 10; the loss spikes at step 13 (readout 14), where layer 1 moved at step 12."""
    out = clean()
    out[0][10] |= {
        "monitors/step/grad_norm_spike_count": 1.0,
        "monitors/step/grad_norm_spike_first_step": 10.0,
        "monitors/step/moved_first_step": 10.0,
        "monitors/step/moved_first_layer": 2.0,
    }
    out[0][14] |= {
        "monitors/step/loss_spike_count": 1.0,
        "monitors/step/loss_spike_first_step": 13.0,
        "monitors/step/moved_first_step": 12.0,
        "monitors/step/moved_first_layer": 1.0,
    }
    return out


def test_spikes_and_the_layer_that_moved_first_head_the_summary(tmp_path) -> None:
    records = spiked()
    run_dir = write(tmp_path / "run", records)
    _, grad_norm = earliest(records, "monitors/step/grad_norm_spike_first_step")
    _, loss = earliest(records, "monitors/step/loss_spike_first_step")
    # the layer named by the readout of the earliest spike, not by a later one
    first_read = min(
        (v, s)
        for s, values in records[0].items()
        for k, v in values.items()
        if k.endswith("_spike_first_step")
    )[1]
    moved = records[0][first_read]
    expected = [
        f"First loss spike: step {loss:.0f}",
        f"First gradient norm spike: step {grad_norm:.0f}",
        f"Layer that moved first: layer {moved['monitors/step/moved_first_layer']:.0f}, "
        f"at step {moved['monitors/step/moved_first_step']:.0f}",
    ]
    assert summary(run_dir)[: len(expected)] == expected
    assert banner(report.build(run_dir)) == expected
