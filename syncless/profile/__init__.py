"""Section profiler: where step time goes, per section, per collective part, across ranks.

See docs/profile.md.
"""

from syncless.profile.calibrate import Calibration
from syncless.profile.off import OFF, NullProfiler
from syncless.profile.profiler import MODES, ProfileMisuse, Profiler
from syncless.profile.report import ProfileReport
from syncless.profile.summary import Late, RankSummary, Row, SectionTotals

__all__ = [
    "MODES",
    "OFF",
    "Calibration",
    "Late",
    "NullProfiler",
    "ProfileMisuse",
    "ProfileReport",
    "Profiler",
    "RankSummary",
    "Row",
    "SectionTotals",
]
