"""syncless summary: the tables name the right layers and numbers, computed here from the
records written (numpy over the known values, not the summary's SQL)."""

from __future__ import annotations

import io
import logging
import re
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from summary_trace_runs import LAYERS, WINDOWS, values, write_run

from syncless.report.summary import print_summary, read

Values = dict[tuple[int, int, str], float]


@pytest.fixture(scope="module")
def known(tmp_path_factory) -> tuple[Path, Values]:
    vals = values()
    return write_run(tmp_path_factory.mktemp("summary") / "run", vals), vals


def render(run_dir: Path) -> str:
    out = io.StringIO()
    print_summary(read(run_dir), out)
    return out.getvalue()


def row(text: str, first: str) -> list[str]:
    """The cells of the first table line whose first cell is ``first``."""
    for line in text.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in\n{text}")


def series(vals: Values, name: str) -> np.ndarray:
    return np.array([v for (_, _, n), v in vals.items() if n == name])


def g4(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:.4g}"


def test_run_and_training_tables_show_last_and_mean(known) -> None:
    run_dir, vals = known
    text = render(run_dir)
    assert row(text, "name")[1] == "known"
    assert row(text, "world size")[1] == "2 (2 with records)"
    assert row(text, "steps")[1] == "0..9 (10 with records)"
    tokens = series(vals, "demo/step/tokens_per_s").mean()
    assert row(text, "throughput")[1] == f"{tokens:,.0f} tokens/s (mean)"
    loss = series(vals, "demo/step/loss")
    last = vals[9, 0, "demo/step/loss"]  # the highest step, the lowest rank
    assert row(text, "demo/step/loss")[1:] == [
        g4(last),
        *map(g4, (loss.mean(), loss.min(), loss.max())),
    ]
    assert row(text, "demo/step/lr")[1] == g4(1e-2)


def test_worst_layers_name_the_layer_head_and_expert(known) -> None:
    run_dir, vals = known
    text = render(run_dir)

    def extreme(metric: str, highest: bool, sub: str | None = None) -> tuple[str, float]:
        best = {}
        for layer in LAYERS:
            v = series(vals, f"monitors/{layer}/{metric}" + (f"/{sub}" if sub else ""))
            best[layer] = v.max() if highest else v.min()
        layer = (max if highest else min)(best, key=best.__getitem__)
        return layer, best[layer]

    def head(metric: str, layer: str, highest: bool) -> str:
        per = {h: series(vals, f"monitors/{layer}/{metric}/head_{h}") for h in range(4)}
        pick = max if highest else min
        return f"head_{pick(per, key=lambda h: per[h].max() if highest else per[h].min())}"

    layer, value = extreme("attn_qk_logit_max", True)
    assert row(text, "attention logit max")[1:4] == [
        layer,
        head("attn_qk_logit_max", layer, True),
        g4(value),
    ]
    layer, value = extreme("attn_entropy_nats", False)
    assert row(text, "attention entropy (nats)")[1:4] == [
        layer,
        head("attn_entropy_nats", layer, False),
        g4(value),
    ]
    for label, metric in (("activation max |x|", "act_absmax"), ("grad norm", "grad_norm"),
                          ("update / param ratio", "update_ratio")):  # fmt: skip
        layer, value = extreme(metric, True)
        assert row(text, label)[1:4] == [layer, "-", g4(value)]
    layer, value = extreme("moe_imbalance", True)
    tokens = {
        e: series(vals, f"monitors/{layer}/moe_tokens_count/expert_{e}").sum() for e in range(4)
    }
    busiest = f"expert_{max(tokens, key=tokens.__getitem__)}"
    assert row(text, "MoE imbalance (max/mean load)")[1:4] == [layer, busiest, g4(value)]
    assert row(text, "nonfinite values (total)")[1:5] == ["layer_01", "-", "2", "7"]
    assert "global" not in text.split("worst layers")[1].split("where step time")[0]


def test_step_time_sections_collective_split_and_culprit(known) -> None:
    run_dir, vals = known
    text = render(run_dir)
    step = series(vals, "profile/step/time_ms").mean()
    forward = series(vals, "profile/forward/time_ms").mean()
    assert row(text, "forward")[1:] == [g4(forward), f"{100 * forward / step:.1f}"]
    parts = [
        g4(series(vals, f"profile/a2a/{p}_ms").mean())
        for p in ("rendezvous", "enqueue", "transfer")
    ]
    router = {r: np.mean([vals[s, r, "profile/router/time_ms"] for s in WINDOWS]) for r in (0, 1)}
    a2a = g4(series(vals, "profile/a2a/time_ms").mean())
    culprit = f"router (+{router[1] - router[0]:.3g})"  # rank 1 is late; the only other is rank 0
    assert row(text.split("collectives")[1], "a2a")[1:] == [a2a, *parts, "1", culprit]


def test_dataplane_worst_first_captures_and_costs(known) -> None:
    run_dir, vals = known
    text = render(run_dir)
    step_ms = series(vals, "demo/step/step_ms").mean()
    lines = text.split("data plane")[1].splitlines()
    ops = [line.split()[0] for line in lines if line.strip().startswith(("get", "put"))]
    assert ops == ["put", "get"]  # put's wall time is 3x get's
    put = series(vals, "dataplane/step/put/wall_ms").mean()
    errors = g4(series(vals, "dataplane/step/put/errors_count").sum())
    assert row(text, "put")[1:] == [g4(put), f"{100 * put / step_ms:.2f}", "3", "1", errors]
    assert row(text, "dropped: ring_full")[1:] == ["5", "2048"]
    assert row(text, "captured")[1] == "6"
    assert "dropped: closed" not in text  # a reason that never dropped is not listed
    overhead = series(vals, "dataplane/step/self/overhead_ms")
    cost = row(text, "dataplane/step/self/overhead_ms")
    assert cost[1:] == [
        g4(overhead.mean()),
        g4(overhead.max()),
        f"{100 * overhead.mean() / step_ms:.2f}",
    ]
    assert row(text, "profile/self/host_ms")[1] == "0.05"


def test_sections_a_run_lacks_are_absent(tmp_path) -> None:
    vals = {(s, 0, "demo/step/loss"): 1.0 + s for s in range(3)}
    text = render(write_run(tmp_path / "run", vals, world_size=1, ranks=(0,)))
    assert row(text, "demo/step/loss")[1] == "3"
    for title in ("worst layers", "where step time goes", "collectives", "data plane",
                  "captures", "what syncless cost"):  # fmt: skip
        assert title not in text


def test_a_killed_run_summarizes_with_a_warning(tmp_path, caplog) -> None:
    vals = values()
    run_dir = write_run(tmp_path / "run", vals, world_size=2, ranks=(0,))  # rank 1 died
    with caplog.at_level(logging.WARNING, logger="syncless"):
        totals = read(run_dir)
    assert totals.warnings == ["records from 1 of 2 ranks: the run is partial"]
    shard = sorted((run_dir / "metrics").glob("rank00000-*.parquet"))[-1]
    shard.write_bytes(shard.read_bytes()[:100])  # truncated: a full disk, a bad copy
    with caplog.at_level(logging.WARNING, logger="syncless"):
        text = render(run_dir)
    assert any("unreadable shard" in r.message and shard.name in r.message for r in caplog.records)
    first_half = [v for (s, r, n), v in vals.items() if n == "demo/step/loss" and r == 0 and s < 5]
    assert row(text, "demo/step/loss")[2] == g4(statistics.fmean(first_half))


def test_the_command_prints_tables_and_warns_on_stderr(tmp_path) -> None:
    run_dir = write_run(tmp_path / "run", values(), world_size=3)
    cli = [sys.executable, "-m", "syncless.cli", "summary"]
    p = subprocess.run([*cli, str(run_dir)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "worst layers" in p.stdout and "collectives" in p.stdout
    assert "syncless: warning: records from 2 of 3 ranks" in p.stderr
    p = subprocess.run(
        [*cli, str(tmp_path / "nothing")], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2 and p.stderr.startswith("syncless: error: ")


def test_sections_follow_the_recorded_nesting(tmp_path) -> None:
    """The records are stored in reverse (summary_trace_runs): the table follows the
    profiler's depth-first order and indents forward's children under it."""
    from summary_trace_runs import NESTING

    text = render(write_run(tmp_path / "run", values(nested=True)))
    table = text.split("where step time goes")[1].split("collectives")[0]
    lines = {
        ln.split()[0]: ln for ln in table.splitlines() if ln.strip() and ln.split()[0] in NESTING
    }
    assert list(lines) == [n for n in sorted(NESTING, key=lambda n: NESTING[n][1]) if n != "step"]
    indent = {n: len(ln) - len(ln.lstrip()) for n, ln in lines.items()}
    assert indent["attention"] == indent["router"] == indent["forward"] + 2
    assert indent["data"] == indent["forward"] == indent["a2a"] == indent["optimizer"]
