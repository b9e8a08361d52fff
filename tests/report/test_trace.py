"""syncless trace: Chrome trace JSON whose durations are the recorded section times."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
from summary_trace_runs import PARTS, SECTIONS, WINDOWS, values, write_run

from syncless.report.trace import Slice, layout, write_trace

Values = dict[tuple[int, int, str], float]


@pytest.fixture(scope="module", params=[True, False], ids=["recorded", "guessed"])
def known(tmp_path_factory, request) -> tuple[Values, list[dict]]:
    """The run with the profiler's nesting records, and one recorded before them."""
    vals = values(nested=request.param)
    run_dir = write_run(tmp_path_factory.mktemp("trace") / "run", vals)
    path = write_trace(run_dir)
    assert path == run_dir / "trace.json"
    return vals, json.loads(path.read_text())["traceEvents"]


def slices(events: list[dict]) -> list[dict]:
    return [e for e in events if e["ph"] == "X"]


def test_every_event_has_the_chrome_fields_and_one_pid_per_rank(known) -> None:
    _, events = known
    for e in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= e.keys(), e
    assert all("dur" in e and e["dur"] >= 0 for e in slices(events))
    assert {e["pid"] for e in events} == {0, 1}
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}


def test_durations_are_the_recorded_times(known) -> None:
    vals, events = known
    for rank, step in itertools.product((0, 1), WINDOWS):
        mine = [e for e in slices(events) if e["pid"] == rank]
        start = next(e["ts"] for e in mine if e["name"] == f"step {step}")
        end = start + vals[step, rank, "profile/step/time_ms"] * 1e3
        window = {e["name"]: e["dur"] for e in mine if start <= e["ts"] <= end}
        expected = {name: vals[step, rank, f"profile/{name}/time_ms"] for name in SECTIONS}
        expected |= {f"a2a/{p}": vals[step, rank, f"profile/a2a/{p}_ms"] for p in PARTS}
        expected[f"step {step}"] = vals[step, rank, "profile/step/time_ms"]
        assert window == pytest.approx({k: v * 1e3 for k, v in expected.items()}, abs=1e-3)


def test_slices_of_a_track_nest_or_follow_never_cross(known) -> None:
    _, events = known
    tracks: dict[tuple[int, int], list[dict]] = {}
    for e in slices(events):
        tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for track in tracks.values():
        for a, b in itertools.combinations(track, 2):
            a_end, b_end = a["ts"] + a["dur"], b["ts"] + b["dur"]
            disjoint = a_end <= b["ts"] + 1e-3 or b_end <= a["ts"] + 1e-3
            nested = (a["ts"] <= b["ts"] and b_end <= a_end + 1e-3) or (
                b["ts"] <= a["ts"] and a_end <= b_end + 1e-3
            )
            assert disjoint or nested, (a, b)


def test_forward_holds_its_children_and_the_step_holds_everything(known) -> None:
    _, events = known
    for rank, step in itertools.product((0, 1), WINDOWS):
        mine = [e for e in slices(events) if e["pid"] == rank]
        whole = next(e for e in mine if e["name"] == f"step {step}")
        end = whole["ts"] + whole["dur"]
        window = {e["name"]: e for e in mine if whole["ts"] <= e["ts"] <= end}
        forward = window["forward"]
        for child in ("attention", "router"):  # the profiler ran them inside forward
            assert window[child]["args"]["depth"] == 1
            assert forward["ts"] <= window[child]["ts"]
            assert (
                window[child]["ts"] + window[child]["dur"] <= forward["ts"] + forward["dur"] + 1e-3
            )
        assert all(e["ts"] + e["dur"] <= end + 1e-3 for e in window.values())


def test_collective_phases_tile_the_collective_and_enqueue_has_its_own_track(known) -> None:
    _, events = known
    mine = [e for e in slices(events) if e["pid"] == 1]
    a2a, rendezvous, transfer, enqueue = (
        next(e for e in mine if e["name"] == n)
        for n in ("a2a", "a2a/rendezvous", "a2a/transfer", "a2a/enqueue")
    )
    assert rendezvous["tid"] == transfer["tid"] == a2a["tid"] != enqueue["tid"]
    assert rendezvous["ts"] == a2a["ts"]
    assert transfer["ts"] == pytest.approx(rendezvous["ts"] + rendezvous["dur"], abs=1e-3)
    assert rendezvous["dur"] + transfer["dur"] <= a2a["dur"]
    assert enqueue["ts"] == pytest.approx(transfer["ts"], abs=1e-3)
    assert a2a["args"]["late_rank"] == 1


def test_layout_lays_flat_sections_end_to_end() -> None:
    flat = [("a", 1.0), ("b", 2.0), ("c", 0.5)]
    expected = [Slice("a", 0.0, 1.0, 0), Slice("b", 1.0, 2.0, 0), Slice("c", 3.0, 0.5, 0)]
    assert layout(flat, step_ms=4.0) == expected
    assert layout(flat, step_ms=4.0, nesting=dict.fromkeys("abc")) == expected


# Two deep: forward > attention > qk, and router in forward after attention. The step's
# sections hold 19 of its 20 ms. The old guess (one level deep) put qk beside attention
# and router outside forward.
DEEP = {"forward": (10.0, 0, 2), "attention": (6.0, 1, 3), "qk": (4.0, 2, 4),
        "router": (3.0, 1, 5), "backward": (9.0, 0, 6)}  # fmt: skip
DEEP_PARENTS = {"forward": None, "attention": "forward", "qk": "attention",
                "router": "forward", "backward": None}  # fmt: skip
DEEP_PLACED = [Slice("forward", 0.0, 10.0, 0), Slice("attention", 0.0, 6.0, 1),
               Slice("qk", 0.0, 4.0, 2), Slice("router", 6.0, 3.0, 1),
               Slice("backward", 10.0, 9.0, 0)]  # fmt: skip


def test_layout_nests_by_the_recorded_parents_at_any_depth() -> None:
    sections = [(name, ms) for name, (ms, _, _) in DEEP.items()]
    assert layout(sections, 20.0, DEEP_PARENTS) == DEEP_PLACED
    guessed = {s.name: s for s in layout(sections, 20.0)}
    assert guessed["qk"].depth == 1 and guessed["router"].depth == 0  # what was wrong


def test_a_two_deep_run_is_traced_by_its_records(tmp_path: Path) -> None:
    vals = {(4, 0, "profile/step/time_ms"): 20.0, (4, 0, "profile/step/depth_count"): 0.0,
            (4, 0, "profile/step/order_count"): 0.0}  # fmt: skip
    for name, (ms, depth, order) in reversed(DEEP.items()):  # stored out of order
        vals[4, 0, f"profile/{name}/time_ms"] = ms
        vals[4, 0, f"profile/{name}/depth_count"] = float(depth)
        vals[4, 0, f"profile/{name}/order_count"] = float(order)
    run_dir = write_run(tmp_path / "run", vals, world_size=1, ranks=(0,))
    events = slices(json.loads(write_trace(run_dir).read_text())["traceEvents"])
    step = next(e for e in events if e["name"] == "step 4")
    placed = [Slice(e["name"], (e["ts"] - step["ts"]) / 1e3, e["dur"] / 1e3, e["args"]["depth"])
              for e in events if e is not step]  # fmt: skip
    by_name = {s.name: s for s in placed}
    for want in DEEP_PLACED:
        got = by_name[want.name]
        assert got.depth == want.depth
        assert (got.start_ms, got.ms) == pytest.approx((want.start_ms, want.ms), abs=1e-6)


def test_a_run_without_profiler_records_exits_1(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", {(0, 0, "demo/step/loss"): 1.0}, world_size=1, ranks=(0,))
    p = subprocess.run([sys.executable, "-m", "syncless.cli", "trace", str(run_dir)],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 1 and "no profiler records" in p.stderr
    assert not (run_dir / "trace.json").exists()


def test_summary_and_trace_import_no_torch(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path / "run", values())
    code = (
        "import sys; from syncless.cli import main\n"
        f"assert main(['summary', {str(run_dir)!r}]) == 0\n"
        f"assert main(['trace', {str(run_dir)!r}]) == 0\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
