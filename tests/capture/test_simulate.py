"""The simulator on small traces, against numbers worked out by hand.

Every trace under traces/ runs at 1 GB/s, i.e. 1000 bytes per microsecond, so a window
of W us carries W * 1000 bytes; records are 1 MiB. The controller's defaults apply:
converged_fraction 0.25, fallback after 3 capacity flushes within 16 occurrences. The
hand-worked traces run the evidence rules alone (``short_occurrence_cap`` off: with it
a window is capped by timing after its first clean transfer, see the tests at the end).
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from syncless.capture.simulate import load_trace, main, parse_trace, simulate

TRACES = Path(__file__).parent / "traces"
MiB = 1 << 20
REQUIRED = {
    "occurrences",
    "transfers",
    "overruns",
    "bytes_moved",
    "bytes_overlapping_critical",
    "converged_at_occurrence",
    "fallback",
    "grants",
}


def summary(name: str) -> dict:
    return simulate(load_trace(str(TRACES / f"{name}.json")))


def test_static_window() -> None:
    """64 MiB staging, a 10 ms window: capacity C = 10,000,000 bytes, 64 MiB ready.

    occ 0: no evidence, 64 MiB  -> overrun, B = 64 MiB
    occ 1: B/2 = 32 MiB         -> overrun, B = 32 MiB
    occ 2: 16 MiB               -> overrun, B = 16 MiB
    occ 3: 8 MiB < C            -> A = 8 MiB
    occ 4: midpoint 12 MiB      -> overrun, B = 12 MiB
    occ 5: midpoint 10 MiB      -> overrun, B = 10 MiB; 10 - 8 <= 0.25 * 10: converged
    occ 6..19: A = 8 MiB        -> fine
    Converged at 5 = ceil(log2(64 MiB / C)) + 2 = ceil(2.75) + 2.
    """
    s = summary("static")
    assert s.keys() >= REQUIRED
    assert s["occurrences"] == 20
    assert s["transfers"] == 20
    assert s["overruns"] == 5
    assert s["converged_at_occurrence"] == 5
    assert s["grants"] == [8 * MiB]
    assert s["fallback"] is False
    c = 10_000_000
    overrun_bytes = [64 * MiB, 32 * MiB, 16 * MiB, 12 * MiB, 10 * MiB]
    assert s["bytes_overlapping_critical"] == sum(b - c for b in overrun_bytes) == 90_509_184
    in_windows = (64 + 32 + 16 + 8 + 12 + 10 + 14 * 8) * MiB
    assert s["bytes_by_path"]["windows"] == in_windows
    assert s["bytes_moved"] == s["bytes_captured"] == 20 * 64 * MiB
    assert s["bytes_by_path"]["lifecycle_flush"] == 20 * 64 * MiB - in_windows
    assert s["flushes"] == {"capacity": 0, "lifecycle": 1, "oversized": 0}
    assert s["evidence"] == [
        {"safe_bytes": 8 * MiB, "unsafe_bytes": 10 * MiB, "estimate_bytes": 9_000_000}
    ]


def test_downward_capacity_shift() -> None:
    """static.json, but from occurrence 10 the window lasts 2.5 ms: C' = 2,500,000.

    occ 10: A = 8 MiB          -> overrun at A: capacity shift, B = 8 MiB
    occ 11: 4 MiB              -> overrun, B = 4 MiB
    occ 12: 2 MiB < C'         -> A = 2 MiB
    occ 13: midpoint 3 MiB     -> overrun, B = 3 MiB; 1 MiB > 0.25 * 3 MiB
    occ 14..: midpoint 2.5 MiB -> two whole records, 2 MiB: fine, nothing changes
    Re-converged at 13 <= 10 + ceil(log2(8 MiB / C')) + 2 = 14.
    """
    s = summary("shift")
    assert s["overruns"] == 5 + 3
    assert s["converged_at_occurrence"] == 13
    assert s["grants"] == [(2 * MiB + 3 * MiB) // 2]
    c, c2 = 10_000_000, 2_500_000
    before = sum(b - c for b in [64 * MiB, 32 * MiB, 16 * MiB, 12 * MiB, 10 * MiB])
    after = sum(b - c2 for b in [8 * MiB, 4 * MiB, 3 * MiB])
    assert s["bytes_overlapping_critical"] == before + after == 98_737_824
    windows = (64 + 32 + 16 + 8 + 12 + 10 + 4 * 8) * MiB + (8 + 4 + 2 + 3 + 6 * 2) * MiB
    assert s["bytes_by_path"]["windows"] == windows


def test_late_close_and_drain_stall_teach_nothing() -> None:
    """static.json with a late CLOSE observation at 4 and a drain stall at 12.

    occ 4: 12 MiB overruns (12,582,912 >= C), but the CLOSE is seen 20 ms late, so the
           copy looks done before it: no evidence (counting it would set A = 12 MiB > C).
    occ 5: the same midpoint, 12 MiB -> overrun, B = 12 MiB
    occ 6: 10 MiB                    -> overrun, B = 10 MiB: converged at 6
    occ 12: 8 MiB issued 5 ms late, ends at 13.39 ms > 10 ms: an overrun at A, which clean
           would be a capacity shift; late, it is no evidence and the grant stays 8 MiB.
    """
    s = summary("late")
    assert s["overruns"] == 7  # 0, 1, 2, 4, 5, 6, 12
    assert s["converged_at_occurrence"] == 6
    assert s["grants"] == [8 * MiB]
    c = 10_000_000
    overruns = [64 * MiB, 32 * MiB, 16 * MiB, 12 * MiB, 12 * MiB, 10 * MiB]
    stalled = 8 * MiB - (10_000 - 5_000) * 1000  # bytes copied after the CLOSE
    assert s["bytes_overlapping_critical"] == sum(b - c for b in overruns) + stalled
    counts = s["controller_counts"]
    assert counts["completion/close_late"] == 1
    assert counts["completion/issued_late"] == 1
    assert "completion/capacity_shift" not in counts


def test_fallback_after_repeated_capacity_flushes() -> None:
    """A 0.5 ms window (500,000 bytes) can never carry a 1 MiB record.

    Each occurrence 4 MiB arrive; the ring holds 8 MiB; staging is 4 MiB.
    occ 0: 4 MiB -> overrun, B = 4 MiB       occ 1: 2 MiB -> overrun (backlog 2 MiB)
    occ 2: 1 MiB -> overrun, B = 1 MiB       (backlog 5 MiB)
    occ 3: 9 MiB > ring: capacity flush #1
    occ 4, 5: the budget (512 KiB) is below a record, and a probe would take 1 MiB /
           1 GB/s = 1.05 ms in a window that lasted 0.5 ms: too short, nothing sent
    occ 6: 12 MiB: capacity flush #2          occ 7, 8: too short (backlog 4, 8 MiB)
    occ 9: 12 MiB: capacity flush #3 within 16 occurrences: fallback
    occ 10, 11: ordinary batching, 4 MiB each
    """
    s = summary("fallback")
    assert s["fallback"] is True
    assert s["fallback_at_occurrence"] == 9
    assert "(at occurrences 3, 6, 9)" in s["fallback_reason"]
    assert s["converged_at_occurrence"] is None
    assert s["transfers"] == s["overruns"] == 3
    assert s["flushes"]["capacity"] == 3
    assert s["bytes_by_path"] == {
        "windows": (4 + 2 + 1) * MiB,
        "capacity_flush": (9 + 12 + 12) * MiB,
        "oversized_flush": 0,
        "batched": 8 * MiB,
        "lifecycle_flush": 0,
    }
    window_overlap = sum(b - 500_000 for b in [4 * MiB, 2 * MiB, MiB])
    assert s["bytes_overlapping_critical"] == window_overlap + (9 + 12 + 12 + 8) * MiB
    assert s["controller_counts"]["grant/too_short"] == 4
    assert "grant/probe" not in s["controller_counts"]


def test_evaluation_phase_causes_no_fallback() -> None:
    """2 MiB per occurrence fits the 10 ms window; occurrences 5..13 are evaluation.

    With no windows the 5 MiB ring fills at 7, 10 and 13: three capacity flushes within
    16 occurrences, which while training would be a fallback. Suspended, they do not
    count, and they do not overlap a critical region.
    """
    s = summary("suspend")
    assert s["fallback"] is False
    assert s["suspended_occurrences"] == 9
    assert s["flushes"]["capacity"] == 3
    assert s["controller_counts"]["flush/capacity_not_counted"] == 3
    assert s["transfers"] == 20 - 9
    assert s["overruns"] == 0
    assert s["bytes_overlapping_critical"] == 0
    assert s["bytes_by_path"]["windows"] == 11 * 2 * MiB
    assert s["bytes_by_path"]["capacity_flush"] == 3 * 6 * MiB
    assert s["bytes_moved"] == 20 * 2 * MiB
    # Staging (4 MiB) was granted from the start and never changed.
    assert s["converged_at_occurrence"] == 0
    assert s["grants"] == [4 * MiB]


def test_two_windows_and_oversized_records() -> None:
    trace = {
        "pattern": {"period": 4, "windows": [[1, 2], [3, 4]]},
        "occurrences": 3,
        "staging_bytes": 3 * MiB,
        "d2h_gb_per_s": 2,  # 2000 bytes per us
        "window_us": [5000, 100],  # 10,000,000 and 200,000 bytes
        "records": {"sizes": [MiB, 4 * MiB, MiB, MiB]},
        "controller": {"short_occurrence_cap": False},
    }
    s = simulate(parse_trace(trace))
    # Each occurrence [1, 4, 1, 1] MiB arrive; the 4 MiB record exceeds staging.
    # occ 0: window 0, budget 3 MiB: 1 MiB (the 4 MiB record stops the prefix), fine.
    #        Window 1: the 4 MiB record goes by an oversized flush; then 2 MiB ->
    #        overrun (>= 200,000), B = 2 MiB.
    # occ 1: window 0: 1 MiB, fine. Window 1: oversized flush; budget B/2 = 1 MiB:
    #        1 MiB -> overrun, B = 1 MiB; one 1 MiB record stays ready.
    # occ 2: window 0: 1 + 1 MiB, fine. Window 1: oversized flush; budget 512 KiB is
    #        below the 1 MiB record, and a probe is ruled out by timing (the window
    #        lasted 100 us, 200,000 bytes at the measured 2 GB/s): 2 MiB left for the close.
    assert s["flushes"]["oversized"] == 3
    assert s["bytes_by_path"]["oversized_flush"] == 3 * 4 * MiB
    assert s["bytes_by_path"]["lifecycle_flush"] == 2 * MiB
    assert s["transfers"] == 5
    assert s["overruns"] == 2
    over = (2 * MiB - 200_000) + (MiB - 200_000)
    assert s["bytes_overlapping_critical"] == over + 3 * 4 * MiB
    assert s["controller_counts"]["grant/too_short"] == 1
    assert "grant/probe" not in s["controller_counts"]
    assert s["bytes_moved"] == s["bytes_captured"] == 3 * 7 * MiB


def test_windows_that_vary_are_budgeted_for_their_short_occurrences() -> None:
    """A 10 ms window lasting 7-10 ms (jitter 0.3), 300 occurrences. E from the latest
    clean transfer budgets each window for the one before it and overruns whenever a
    long occurrence precedes a short one; E from the 10% quantile of the last 16 keeps
    the overruns to the initial bisection (a static window of this size needs 5, the
    shortest occurrence here is shorter still, so it converges no later)."""
    trace = json.loads((TRACES / "jitter.json").read_text())
    history = simulate(parse_trace(trace))
    latest = simulate(
        parse_trace({**trace, "controller": {"short_occurrence_cap": False, "estimate_history": 1}})
    )
    static = simulate(parse_trace({**trace, "jitter": {"fraction": 0}}))
    assert static["overruns"] == 5 and static["transfers"] == 300
    assert history["overruns"] <= static["overruns"]
    assert latest["overruns"] >= history["overruns"] + 3
    assert history["bytes_overlapping_critical"] < latest["bytes_overlapping_critical"]
    # the price: a few percent fewer bytes carried in windows
    windows = history["bytes_by_path"]["windows"]
    assert 0.95 * latest["bytes_by_path"]["windows"] <= windows < latest["bytes_by_path"]["windows"]
    # the same draws every run
    assert simulate(parse_trace(trace)) == history


def test_the_short_occurrence_cap_budgets_a_window_for_its_short_occurrences() -> None:
    """The default controller on the jitter trace: every occurrence's duration is
    evidence, so after the first clean transfer (which measures the bandwidth) no
    occurrence is budgeted above 0.9 x bandwidth x its short recent durations; only the
    first, no-evidence transfer overruns."""
    trace = json.loads((TRACES / "jitter.json").read_text())
    evidence_only = simulate(parse_trace(trace))
    capped = simulate(parse_trace({**trace, "controller": {}}))
    assert capped["overruns"] == 1 < evidence_only["overruns"]
    assert capped["bytes_overlapping_critical"] < evidence_only["bytes_overlapping_critical"]
    assert capped["controller_counts"]["grant/short_occurrences"] > 0


def test_static_window_with_the_short_occurrence_cap() -> None:
    """static.json with the default controller. occ 0: no evidence, 64 MiB -> overrun
    (67.1 ms in a 10 ms window), B = 64 MiB, bandwidth 1 GB/s measured. occ 1: the
    window lasted 10 ms, so the cap is 0.9 x 1 GB/s x 10 ms = 9,000,000 bytes, below
    B / 2: 8 records (8 MiB) -> fine, A = 8 MiB. Converged at 1, not after a bisection."""
    trace = {**json.loads((TRACES / "static.json").read_text()), "controller": {}}
    s = simulate(parse_trace(trace))
    assert s["overruns"] == 1
    assert s["converged_at_occurrence"] == 1
    assert s["grants"] == [9_000_000]
    assert s["bytes_overlapping_critical"] == 64 * MiB - 10_000_000
    assert s["evidence"] == [
        {"safe_bytes": 8 * MiB, "unsafe_bytes": 64 * MiB, "estimate_bytes": 9_000_000}
    ]


def test_uniform_records_are_reproducible() -> None:
    trace = json.loads((TRACES / "static.json").read_text())
    trace["records"] = {"count": 5, "min_bytes": 1000, "max_bytes": 900_000, "seed": 3}
    trace["occurrences"] = 7
    rng = random.Random(3)
    expected = sum(rng.randint(1000, 900_000) for _ in range(5 * 7))
    first = simulate(parse_trace(trace))
    assert first["bytes_captured"] == first["bytes_moved"] == expected
    assert simulate(parse_trace(trace)) == first


def test_command_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "syncless.capture.simulate", str(TRACES / "static.json")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    out = json.loads(proc.stdout)
    assert out.keys() >= REQUIRED
    assert out == summary("static")

    bad = tmp_path / "bad.json"
    bad.write_text('{"pattern": {"period": 4, "windows": [[0, 2], [1, 3]]}}')
    proc = subprocess.run(
        [sys.executable, "-m", "syncless.capture.simulate", str(bad)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "is missing 'occurrences'" in proc.stderr


def _base() -> dict:
    return json.loads((TRACES / "static.json").read_text())


def _with(**changes) -> dict:
    trace = _base()
    for key, value in changes.items():
        if value is None:
            trace.pop(key)
        else:
            trace[key] = value
    return trace


@pytest.mark.parametrize(
    ("trace", "fragments"),
    [
        ([1, 2], ["must be a JSON object"]),
        (_with(occurrences=None), ["is missing 'occurrences'"]),
        (_with(windows=[[0, 1]]), ["unknown key(s) 'windows'", "expected keys"]),
        (
            _with(pattern={"period": 4, "windows": [[0, 2], [1, 3]]}),
            [".pattern: WindowPattern: window 0 (0, 2) and window 1 (1, 3) overlap"],
        ),
        (_with(pattern={"period": 0, "windows": [[0, 1]]}), ["period must be >= 1"]),
        (_with(occurrences=0), [".occurrences must be >= 1, got 0"]),
        (_with(staging_bytes=1.5), [".staging_bytes must be an integer, got 1.5"]),
        (_with(d2h_gb_per_s=0), [".d2h_gb_per_s must be > 0"]),
        (_with(window_us=[1, 2]), ["window_us has 2 entries but the pattern has 1 window(s)"]),
        (_with(window_us=[-1]), [".window_us[0] must be >= 0"]),
        (_with(window_us=["5"]), [".window_us[0] must be a finite number, got '5'"]),
        (_with(records={"count": 2}), [".records must be {'sizes': [...]}"]),
        (_with(records={"sizes": [0]}), [".records.sizes[0] must be >= 1"]),
        (_with(records={"sizes": [1], "count": 2}), ["'sizes' stands alone"]),
        (
            _with(records={"count": 1, "min_bytes": 5, "max_bytes": 4, "seed": 0}),
            [".records.max_bytes must be >= 5"],
        ),
        (_with(suspend=[[5, 3]]), [".suspend[0] is [5, 3]", "0 <= start < end <= occurrences"]),
        (_with(suspend=[5]), [".suspend[0] must be a [start, end) pair"]),
        (
            _with(drain_stalls=[{"occurrence": 99, "delay_us": 1}]),
            [".drain_stalls[0].occurrence is 99 but the trace has 20 occurrences"],
        ),
        (
            _with(late_close=[{"occurrence": 1, "position": 1, "lag_us": 1}]),
            [".late_close[0].position is 1 but the pattern has 1 window(s)"],
        ),
        (_with(late_close=[{"occurrence": 1}]), [".late_close[0] is missing 'lag_us'"]),
        (_with(changes=[{"occurrence": 1}]), [".changes[0] changes nothing"]),
        (_with(controller={"unsafe_expiry": 0}), [".controller: ControllerConfig.unsafe_expiry"]),
        (_with(controller={"expiry": 5}), [".controller has unknown key(s) 'expiry'"]),
        (
            _with(controller={"short_occurrence_cap": 1}),
            [".controller: ControllerConfig.short_occurrence_cap must be True or False"],
        ),
        (_with(jitter={"fraction": 1}), [".jitter.fraction is 1; expected [0, 1)"]),
        (_with(jitter={"seed": 1}), [".jitter is missing 'fraction'"]),
        (
            _with(controller={"estimate_quantile": 2}),
            [".controller: ControllerConfig.estimate_quantile must be in [0, 1]"],
        ),
    ],
)
def test_bad_traces_exit_2_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], trace: object, fragments: list[str]
) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    assert main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m syncless.capture.simulate: error: ")
    assert str(path) in err
    for fragment in fragments:
        assert fragment in err, (fragment, err)


def test_unreadable_and_malformed_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "missing.json")]) == 2
    assert "cannot read trace" in capsys.readouterr().err
    path = tmp_path / "broken.json"
    path.write_text('{"pattern": ')
    assert main([str(path)]) == 2
    assert "is not valid JSON" in capsys.readouterr().err
