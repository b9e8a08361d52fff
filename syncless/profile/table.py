"""The per-report rich table: rows, the spread across ranks, and what the mode distorts."""

from __future__ import annotations

from rich.table import Table

from syncless.profile.calibrate import Calibration
from syncless.profile.summary import Late, Row

DISTORTION = {
    "events": (
        "mode events: device times from CUDA events read one step late; the host never "
        "waits inside the step (costs one event record per span edge)"
    ),
    "events-cpu": (
        "mode events on CPU: host clock (perf_counter_ns); gloo collectives are "
        "synchronous, so host durations are the collective durations"
    ),
    "collectives": (
        "mode collectives: the device is synchronised before and after each collective "
        "span only, so collective times are exact and the profiler adds no arrival "
        "jitter between rendezvous points; other sections as in events"
    ),
    "sync": (
        "mode sync: every span edge synchronises the device - serialized: read the "
        "split, not the total"
    ),
}

SKEW_CAVEAT = (
    "rendezvous = this rank's own wait in a 1-element all_reduce issued just before the "
    "collective: arrival skew seen by the early rank. Ranks can trade the lead call by "
    "call, so the sum of signed skew across ranks can be near zero while every call "
    "waits: read each rank's per-call wait, not an aggregate."
)


def graph_notes(timed: int, untimed: int, untimed_record: str) -> list[str]:
    """Caption lines for spans captured into CUDA graphs (none without a capture)."""
    notes = []
    if timed:
        notes.append(
            f"{timed} span(s) inside CUDA graphs: timed on the device at every replay "
            "(%globaltimer stamps in the graph, read after the step); their calls count "
            "replays"
        )
    if untimed:
        notes.append(
            f"{untimed} span(s) captured in CUDA graphs are not timed at their replays "
            f"({untimed_record}; a warning named their sections)"
        )
    return notes


def _ms(x: float) -> str:
    return f"{x:.3f}"


def render(
    title: str,
    rows: list[Row],
    lates: list[Late],
    distortion: str,
    calibration: Calibration | None,
    notes: list[str] | None = None,
) -> Table:
    """Build the table; callers print it (``rich.console.Console().print(table)``)."""
    table = Table(title=title, title_justify="left")
    for col, justify in (
        ("section", "left"),
        ("category", "left"),
        ("ms/step", "right"),
        ("% of step", "right"),
        ("calls/step", "right"),
        ("µs/call", "right"),
        ("GB/s", "right"),
        ("min ms", "right"),
        ("median ms", "right"),
        ("max ms", "right"),
        ("max rank", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        table.add_row(
            "  " * r.depth + r.name,
            r.category,
            _ms(r.ms_per_step),
            f"{r.pct_of_step:.1f}",
            f"{r.calls_per_step:.2f}",
            f"{r.us_per_call:.1f}",
            "" if r.gb_per_s is None else f"{r.gb_per_s:.3g}",
            _ms(r.rank_min_ms),
            _ms(r.rank_median_ms),
            _ms(r.rank_max_ms),
            str(r.max_rank),
        )
    notes = [distortion, *(notes or [])]
    if calibration is not None:
        notes.append(calibration.describe())
    for late in lates:
        waits = ", ".join(f"r{i}={w:.3f}" for i, w in enumerate(late.wait_ms_per_call))
        culprit = (
            f"likely culprit: section '{late.culprit}' (+{late.culprit_excess_ms:.3f} "
            "ms/step over the other ranks' median)"
            if late.culprit
            else "no section stands out on that rank"
        )
        notes.append(
            f"{late.collective}: late rank {late.late_rank} (smallest own wait; per-call "
            f"wait ms by rank index: {waits}); {culprit}"
        )
    notes.append(SKEW_CAVEAT)
    table.caption = "\n".join(notes)
    table.caption_justify = "left"
    return table
