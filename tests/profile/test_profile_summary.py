"""Cross-rank rows and late-rank verdicts from hand-built summaries (known answers)."""

from syncless.profile import RankSummary, SectionTotals
from syncless.profile.summary import late_ranks, rows


def _summary(rank, steps, step_ms, sections):
    secs = {"step": SectionTotals("step", "step", "step", None, step_ms * 1e6 * steps, steps)}
    for name, (kind, parent, ms, calls) in sections.items():
        secs[name] = SectionTotals(name, "compute", kind, parent, ms * 1e6 * steps, calls * steps)
    return RankSummary(rank, steps, step_ms * 1e6 * steps, 0.0, 0, secs)


def _ranks():
    # rank 2 is late: 'outer/inner' is 30 ms longer there; rank 0 waits most.
    waits = {0: 31.0, 1: 30.0, 2: 0.5}
    inner = {0: 10.0, 1: 11.0, 2: 40.0}
    out = []
    for r in range(3):
        out.append(
            _summary(
                r,
                4,
                100.0,
                {
                    "outer": ("section", None, inner[r] + 5.0, 1),
                    "inner": ("section", "outer", inner[r], 2),
                    "a2a": ("collective", None, waits[r] + 1.0, 1),
                    "a2a/rendezvous": ("part", "a2a", waits[r], 1),
                    "a2a/transfer": ("part", "a2a", 1.0, 1),
                },
            )
        )
    return out


def test_rows_spread_and_order():
    rs = rows(_ranks(), 1)
    assert [(r.name, r.depth) for r in rs] == [
        ("step", 0),
        ("outer", 0),
        ("inner", 1),
        ("a2a", 0),
        ("a2a/rendezvous", 1),
        ("a2a/transfer", 1),
    ]
    inner = rs[2]
    assert inner.ms_per_step == 11.0  # rank 1's own view
    assert inner.calls_per_step == 2.0
    assert inner.us_per_call == 5500.0
    assert abs(inner.pct_of_step - 11.0) < 1e-9
    assert (inner.rank_min_ms, inner.rank_median_ms, inner.rank_max_ms) == (10.0, 11.0, 40.0)
    assert inner.max_rank == 2


def test_late_rank_and_culprit_prefers_the_nested_section():
    (late,) = late_ranks(_ranks())
    assert late.collective == "a2a"
    assert late.late_rank == 2
    assert late.wait_ms_per_call == [31.0, 30.0, 0.5]
    # 'outer' and 'inner' both exceed the median by 29.5 ms; the nested one is named.
    assert late.culprit == "inner"
    assert abs(late.culprit_excess_ms - 29.5) < 1e-9


def test_single_rank_has_no_late_rank():
    assert late_ranks(_ranks()[:1]) == []
