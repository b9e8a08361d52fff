"""``StaticPlanCache``: compute a static router's dispatch plan once, then reuse it.

With a router whose per-expert counts do not depend on its input (a benchmark's fixed
router, any assignment by token position alone), the plan of every layer and every step is
the same, so the per-layer counts exchange and host drain are pure overhead. The cache
removes both. It is only correct when the router really is static, hence:

* **explicit opt-in**: ``StaticPlanCache(enabled=True)`` or ``SYNCLESS_STATIC_PLAN=1``
  (the variable is read when ``enabled`` is left ``None``); otherwise ``get`` always
  misses and the caller computes every plan the usual way;
* **validation**: every ``validate_every`` steps each reuse compares the fresh counts
  with the cached ones on the device; mismatches accumulate in a device counter that is
  read only at a report point (``mismatches()`` / ``check()``), never on the hot path;
* **one log line** per plan on stderr, the first time it is reused, so a run says that
  it is not computing its splits.

Every rank must see the same sequence of keys: a hit on one rank and a miss on another
means one rank issues a counts exchange the other never joins (a hang). Fixed-shape
batches give that for free; variable token counts per rank do not.

Probes, for bisecting a regression: ``probe="no-drains"`` removes only the drains (the
counts exchange still runs every layer), ``probe="no-collective"`` removes only the
exchange (the host still drains every layer). The caller implements them: it reads
``exchanges_counts`` and ``drains``.
"""

from __future__ import annotations

import os
import sys
from typing import Literal

import torch
import torch.distributed as dist

from syncless.hot_path import hot_path
from syncless.pacing.plan import DispatchPlan, PlanKey

ENV_ENABLE = "SYNCLESS_STATIC_PLAN"
ENV_VALIDATE_EVERY = "SYNCLESS_STATIC_PLAN_VALIDATE_EVERY"
ENV_PROBE = "SYNCLESS_STATIC_PLAN_PROBE"

Probe = Literal["no-drains", "no-collective"]
PROBES: tuple[str, ...] = ("no-drains", "no-collective")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class StaticPlanError(RuntimeError):
    """A cached plan no longer matched the router's counts: tokens were mis-routed."""


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1 or 0 (also true/false, on/off)")


def _env_int(name: str) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return 0
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number of steps (0: off)") from None


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where a scratch tensor for a collective on ``group`` must live."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class StaticPlanCache:
    """Dispatch plans keyed by ``PlanKey``; see the module docstring.

    ``enabled``: the opt-in (``None``: read ``SYNCLESS_STATIC_PLAN``).
    ``validate_every``: compare reused plans with fresh counts on every Nth step (0:
    never; ``None``: read ``SYNCLESS_STATIC_PLAN_VALIDATE_EVERY``, default 0). Steps
    are counted by ``step()``; step 0 is validated.
    ``probe``: ``"no-drains"`` or ``"no-collective"`` (``None``: read
    ``SYNCLESS_STATIC_PLAN_PROBE``, default no probe).
    """

    def __init__(
        self,
        enabled: bool | None = None,
        *,
        validate_every: int | None = None,
        probe: Probe | None = None,
    ) -> None:
        self.enabled = _env_flag(ENV_ENABLE) if enabled is None else enabled
        self.validate_every = (
            _env_int(ENV_VALIDATE_EVERY) if validate_every is None else validate_every
        )
        if self.validate_every < 0:
            raise ValueError(f"validate_every must be >= 0 (0: off), got {self.validate_every}")
        if probe is None:
            probe = os.environ.get(ENV_PROBE, "").strip() or None  # type: ignore[assignment]
        if probe is not None and probe not in PROBES:
            raise ValueError(f"probe {probe!r}: expected one of {', '.join(PROBES)} or None")
        self.probe = probe
        self._plans: dict[PlanKey, DispatchPlan] = {}
        self._logged: set[PlanKey] = set()
        self._step = 0
        self.validating = self.validate_every > 0
        # Mismatching validated reuses, per device: a device tensor, read only by
        # mismatches(). Allocated by put(), so reuses never allocate.
        self._mismatches: dict[torch.device, torch.Tensor] = {}
        self.hits = 0
        self.misses = 0
        self.disabled_lookups = 0
        self.validations = 0
        self.unchecked_reuses = 0  # reuses in steps without validation: not looked at

    # -- what a dispatcher must honour ------------------------------------------------

    @property
    def exchanges_counts(self) -> bool:
        """Probe ``no-drains``: keep the per-layer counts exchange."""
        return self.probe == "no-drains"

    @property
    def drains(self) -> bool:
        """Probe ``no-collective``: keep the per-layer host drain."""
        return self.probe == "no-collective"

    # -- hot path -----------------------------------------------------------------------

    @hot_path
    def get(self, key: PlanKey) -> DispatchPlan | None:
        """The cached plan for ``key``; ``None`` when disabled or not cached yet."""
        if not self.enabled:
            self.disabled_lookups += 1
            return None
        plan = self._plans.get(key)
        if plan is None:
            self.misses += 1
            return None
        self.hits += 1
        if not self.validating:
            self.unchecked_reuses += 1
        if key not in self._logged:
            self._logged.add(key)
            self._log_first_reuse(key, plan)
        return plan

    def put(self, key: PlanKey, plan: DispatchPlan) -> None:
        """Cache ``plan`` (computed the usual way, with its drain) for ``key``."""
        if not self.enabled:
            raise RuntimeError(
                "StaticPlanCache.put() on a disabled cache: check `cache.enabled` first "
                f"(opt in with enabled=True or {ENV_ENABLE}=1)"
            )
        self._plans[key] = plan
        self._counter(plan.send_counts_device.device)  # allocated here, off the reuse path

    @hot_path
    def validate(self, plan: DispatchPlan, send_counts: torch.Tensor) -> None:
        """In a validated step, count (on the device) a reuse whose fresh counts differ.

        ``send_counts``: this rank's rows per global expert, computed from the routing
        of the call that reused ``plan``. Comparing the send side on every rank covers
        the receive side too: what a rank receives is what the others send.
        """
        if not self.validating:
            return
        self.validations += 1
        counter = self._counter(send_counts.device)
        counter.add_((send_counts != plan.send_counts_device).any())

    def _counter(self, device: torch.device) -> torch.Tensor:
        counter = self._mismatches.get(device)
        if counter is None:  # a device fill, no sync
            counter = self._mismatches[device] = torch.zeros((), dtype=torch.int64, device=device)
        return counter

    # -- cold path ----------------------------------------------------------------------

    def step(self) -> None:
        """Advance the validation schedule; call once per training step, after it."""
        self._step += 1
        self.validating = self.validate_every > 0 and self._step % self.validate_every == 0

    def mismatches(self, *, all_ranks: bool = False, group: dist.ProcessGroup | None = None) -> int:
        """Validated reuses whose plan did not match, read back now (a sync: cold path).

        With ``all_ranks`` the count is the maximum over the ranks of ``group`` (one
        scalar all_reduce: every rank must call it at the same point).
        """
        reduce = all_ranks and dist.is_initialized()
        if not self._mismatches and not reduce:
            return 0
        device = next(iter(self._mismatches), None) or _collective_device(group)
        total = torch.zeros((), dtype=torch.int64, device=device)
        for counter in self._mismatches.values():
            total += counter.to(device)
        if reduce:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        return int(total.item())

    def check(self, *, all_ranks: bool = False, group: dist.ProcessGroup | None = None) -> None:
        """Raise ``StaticPlanError`` if any validated reuse did not match."""
        n = self.mismatches(all_ranks=all_ranks, group=group)
        if n:
            raise StaticPlanError(
                f"static dispatch plan: {n} validated reuse(s) did not match the router's "
                "counts, so tokens were sent to the wrong experts in those calls. The "
                "router is not static for this key (its counts change with the input or "
                "the layer). Use per-layer split computation (drain or lookahead), not "
                "the static plan cache."
            )

    def clear(self) -> None:
        """Forget every plan (the next call per key recomputes and logs it again)."""
        self._plans.clear()
        self._logged.clear()

    def __len__(self) -> int:
        return len(self._plans)

    def stats(self) -> dict[str, int]:
        """Counters since construction (host ints; no device read)."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "disabled_lookups": self.disabled_lookups,
            "validations": self.validations,
            "unchecked_reuses": self.unchecked_reuses,
            "plans": len(self._plans),
        }

    def _log_first_reuse(self, key: PlanKey, plan: DispatchPlan) -> None:
        rank = f"rank {dist.get_rank()}: " if dist.is_initialized() else ""
        checks = (
            f"validated every {self.validate_every} step(s)"
            if self.validate_every
            else "not validated"
        )
        probe = f", probe {self.probe}" if self.probe else ""
        # One write per line: several ranks share the terminal.
        sys.stderr.write(
            f"syncless.pacing: {rank}reusing a static dispatch plan ({checks}{probe}) for "
            f"{key.describe()}: {plan.describe()}\n"
        )
        sys.stderr.flush()
