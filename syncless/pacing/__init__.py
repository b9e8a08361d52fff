"""Pacing for MoE dispatch: fewer host drains without letting the host run away.

``StaticPlanCache`` reuses a static router's dispatch plan (opt-in, validated on the
device), ``RunAheadLimiter`` bounds how far the host runs ahead once the drains are
gone, and ``HostLanding`` lands routing counts in pinned host memory so they can be
read later instead of drained. See docs/pacing.md.
"""

from syncless.pacing.cache import (
    ENV_ENABLE,
    ENV_PROBE,
    ENV_VALIDATE_EVERY,
    PROBES,
    Probe,
    StaticPlanCache,
    StaticPlanError,
)
from syncless.pacing.limiter import EventLike, RunAheadLimiter
from syncless.pacing.lookahead import HostLanding
from syncless.pacing.plan import DispatchPlan, PlanKey

__all__ = [
    "ENV_ENABLE",
    "ENV_PROBE",
    "ENV_VALIDATE_EVERY",
    "PROBES",
    "DispatchPlan",
    "EventLike",
    "HostLanding",
    "PlanKey",
    "Probe",
    "RunAheadLimiter",
    "StaticPlanCache",
    "StaticPlanError",
]
