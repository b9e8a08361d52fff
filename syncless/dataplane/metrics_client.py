"""``MetricsClient``: what every put/get/clear costs, per op, per step, across ranks.

Wraps any ``KVClient``. Per op: calls, errors, wall time, bytes and keys, a mergeable
log-bucket latency histogram (1% relative error) and an exact step maximum. ``step()``
turns cumulative counters into per-step metrics by differencing. Optional
``verify_hash=True`` adds an order-aware per-row digest to every tensor field on put (a
mirror field ``<field>.__digest`` in the same put) and verifies it on get, in this or
any other process.

Accounting never fails the step: an exception inside it is counted
(``dataplane/step/self/accounting_errors_count``) and logged once, and the inner
result is returned. An exception of the inner client is counted as the op's error and
re-raised (it is the caller's operation that failed).

Bytes: a byte written and later read counts on both sides (put MB and get MB each count
it), as it crosses the wire twice. Outstanding bytes are what this client put and has not
cleared, per partition; a clear releases them pro rata (cleared keys x bytes per key
held), and every ``reconcile_every`` steps the count is reconciled against
``list_keys``, so a writer whose keys a reader in another process clears does not leak.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from syncless.dataplane.bytes import payload_nbytes
from syncless.dataplane.client import Fields, FieldValue, KVClient, field_rows
from syncless.dataplane.histogram import LogHistogram
from syncless.dataplane.integrity import IntegrityResult, row_digests, verify_rows

log = logging.getLogger(__name__)
_PERCENTILE = re.compile(r"p\d+_ms")

OPS = ("put", "get", "clear", "list_keys")
DIGEST_SUFFIX = ".__digest"
Event = Callable[[str, str, int, int, float], None]  # op, partition, keys, bytes, ms


@dataclass
class OpCounters:
    """Cumulative counters of one op (``max_ms`` and ``hist`` since the last step)."""

    calls: int = 0
    errors: int = 0
    wall_ns: int = 0
    inner_ns: int = 0
    bytes: int = 0
    keys: int = 0
    max_ms: float = 0.0  # since the last step()
    hist: LogHistogram = field(default_factory=LogHistogram)  # since the last step()


@dataclass
class GuardCounters:
    rows_checked: int = 0
    mismatches: int = 0
    rows_unverified: int = 0
    fields_skipped: int = 0
    failures: int = 0


class MetricsClient:
    def __init__(
        self,
        inner: KVClient,
        *,
        verify_hash: bool = False,
        reconcile_every: int = 100,
        on_event: Event | None = None,
    ) -> None:
        self.inner = inner
        self.verify_hash = verify_hash
        self.reconcile_every = reconcile_every
        self.on_event = on_event
        self.ops = {op: OpCounters() for op in OPS}
        self.guard = GuardCounters()
        self.accounting_errors = 0
        self.unsized_fields = 0
        self._logged: set[str] = set()
        self._held: dict[str, list] = {}  # partition -> [keys, bytes] this client put
        self.outstanding_bytes = 0
        self.peak_bytes = 0
        self._pending_checks: list[IntegrityResult] = []
        self._last: dict[str, OpCounters] = {op: OpCounters() for op in OPS}
        # The last step's latency histograms, for a cluster-wide distribution.
        self.step_histograms: dict[str, LogHistogram] = {}
        self._steps = 0

    # -- the client protocol ------------------------------------------------------

    def put(self, partition: str, keys: Sequence[str], fields: Fields) -> None:
        start = time.perf_counter_ns()
        nbytes, sent = 0, dict(fields)
        try:
            nbytes = self._payload_bytes(fields.values())
            if self.verify_hash:
                sent.update(self._digest_fields(fields))
        except Exception as e:
            self._accounting_failed("put", e)
        self._call("put", partition, keys, nbytes, start, self.inner.put, partition, keys, sent)
        try:
            # Per partition, keys and bytes held: O(1) per put, where a per-key table cost
            # ~10 us at 256 keys. Clears release bytes pro rata.
            held = self._held.setdefault(partition, [0, 0.0])
            held[0] += len(keys)
            held[1] += nbytes
            self.outstanding_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.outstanding_bytes)
        except Exception as e:
            self._accounting_failed("put", e)

    def get(
        self, partition: str, keys: Sequence[str], fields: Sequence[str] | None = None
    ) -> dict[str, FieldValue]:
        start = time.perf_counter_ns()
        asked = fields
        if self.verify_hash and fields is not None:
            asked = [*fields, *(f + DIGEST_SUFFIX for f in fields)]
        try:
            out = self._call("get", partition, keys, None, start, self.inner.get, partition,
                             keys, asked)  # fmt: skip
        except KeyError:
            if not (self.verify_hash and fields is not None):
                raise
            # The writer did not digest: a plain get, its rows counted as unverified.
            out = self._call("get", partition, keys, None, start, self.inner.get, partition,
                             keys, fields)  # fmt: skip
            for value in out.values():
                if isinstance(value, torch.Tensor):
                    self.guard.rows_unverified += field_rows(value)
            return out
        if self.verify_hash:
            self._verify(out)  # pops the mirrors it checks
        else:  # a writer digested, this reader does not check: hide the mirrors
            for name in [n for n in out if n.endswith(DIGEST_SUFFIX)]:
                del out[name]
        return out

    def clear(self, partition: str, keys: Sequence[str]) -> None:
        start = time.perf_counter_ns()
        self._call("clear", partition, keys, 0, start, self.inner.clear, partition, keys)
        try:
            self._release_count(partition, len(keys))
        except Exception as e:
            self._accounting_failed("clear", e)

    def list_keys(self, partition: str) -> list[str]:
        start = time.perf_counter_ns()
        return self._call("list_keys", partition, (), 0, start, self.inner.list_keys, partition)

    # -- accounting -----------------------------------------------------------------

    def _call(self, op, partition, keys, nbytes, start, fn, *args):
        counters = self.ops[op]
        inner_start = time.perf_counter_ns()
        try:
            result = fn(*args)
        except Exception:
            counters.errors += 1
            raise
        finally:
            inner_ns = time.perf_counter_ns() - inner_start
            counters.inner_ns += inner_ns
        try:
            if nbytes is None:  # get: count what came back (the digests are the guard's)
                nbytes = self._payload_bytes(
                    v for k, v in result.items() if not k.endswith(DIGEST_SUFFIX)
                )
            wall_ns = time.perf_counter_ns() - start
            ms = wall_ns / 1e6
            counters.calls += 1
            counters.wall_ns += wall_ns
            counters.bytes += nbytes
            counters.keys += len(keys)
            counters.max_ms = max(counters.max_ms, ms)
            counters.hist.record(ms)
            if self.on_event is not None:
                self.on_event(op, partition, len(keys), nbytes, ms)
        except Exception as e:
            self._accounting_failed(op, e)
        return result

    def _payload_bytes(self, values) -> int:
        total = 0
        for v in values:
            n = payload_nbytes(v)
            if n is None:  # not sizeable without a device read, or an unsupported type
                self.unsized_fields += 1
                continue
            total += n
        return total

    def _release_count(self, partition: str, n: int) -> None:
        """Release ``n`` of this partition's keys, pro rata to the bytes held."""
        held = self._held.get(partition)
        if not held or held[0] == 0:
            return
        n = min(n, held[0])
        freed = held[1] * n / held[0]
        held[0] -= n
        held[1] -= freed
        self.outstanding_bytes -= freed

    def _accounting_failed(self, op: str, err: Exception) -> None:
        self.accounting_errors += 1
        if op not in self._logged:
            self._logged.add(op)
            log.warning("syncless dataplane: accounting of %s failed (%r); counting", op, err)

    # -- wire integrity -----------------------------------------------------------------

    def _digest_fields(self, fields: Fields) -> dict[str, torch.Tensor]:
        mirrors = {}
        for name, value in fields.items():
            if isinstance(value, torch.Tensor):
                mirrors[name + DIGEST_SUFFIX] = row_digests(value)
            else:
                # A placeholder mirror, so a reader can ask for every field's mirror in
                # the same get without knowing which fields are tensors.
                mirrors[name + DIGEST_SUFFIX] = torch.zeros(len(value), dtype=torch.int64)
                self.guard.fields_skipped += 1
        return mirrors

    def _verify(self, out: dict[str, FieldValue]) -> None:
        for name in [n for n in out if not n.endswith(DIGEST_SUFFIX)]:
            value = out[name]
            mirror = out.pop(name + DIGEST_SUFFIX, None)
            if not isinstance(value, torch.Tensor):
                self.guard.fields_skipped += 1
                continue
            if mirror is None:
                self.guard.rows_unverified += field_rows(value)
                continue
            try:
                expected = mirror.values() if mirror.is_nested else mirror
                self._pending_checks.append(verify_rows(value, expected.reshape(-1)))
            except Exception as e:
                self.guard.failures += 1
                self._accounting_failed("verify", e)

    def _resolve_checks(self) -> None:
        """Read the pending device-side checks (cold path: at step())."""
        checks, self._pending_checks = self._pending_checks, []
        for r in checks:
            try:
                bad = int(r.mismatch_count.item())  # syncless: ok step() is the flush point
            except Exception as e:
                self.guard.failures += 1
                self._accounting_failed("verify", e)
                continue
            self.guard.rows_checked += r.rows
            self.guard.mismatches += bad
            if bad:
                rows = r.mismatch.nonzero().flatten()[:8].tolist()  # syncless: ok flush
                log.warning(
                    "syncless dataplane: %d of %d rows failed the wire digest (rows %s)%s",
                    bad, r.rows, rows,
                    "; every row: more likely a bug in the check than in the wire"
                    if bad == r.rows else "",
                )  # fmt: skip

    # -- per step ------------------------------------------------------------------------

    def step(self, step_wall_ms: float | None = None) -> dict[str, float]:
        """Per-step metrics since the last call (cold path), by differencing."""
        start = time.perf_counter_ns()
        self._resolve_checks()
        self._steps += 1
        if self.reconcile_every and self._steps % self.reconcile_every == 0:
            self._reconcile()
        out: dict[str, float] = {}
        total_ms, overhead_ns = 0.0, 0
        for op in OPS:
            now, last = self.ops[op], self._last[op]
            wall_ms = (now.wall_ns - last.wall_ns) / 1e6
            calls = now.calls - last.calls
            total_ms += wall_ms
            overhead_ns += (now.wall_ns - last.wall_ns) - (now.inner_ns - last.inner_ns)
            p = f"dataplane/step/{op}"
            out[f"{p}/calls_count"] = calls
            out[f"{p}/errors_count"] = now.errors - last.errors
            out[f"{p}/wall_ms"] = wall_ms
            out[f"{p}/mb"] = (now.bytes - last.bytes) / 2**20
            out[f"{p}/keys_count"] = now.keys - last.keys
            if calls:
                out[f"{p}/max_ms"] = now.max_ms
                for q, v in now.hist.percentiles_gated().items():
                    out[f"{p}/p{round(q * 100)}_ms"] = min(v, now.max_ms)
            self._last[op] = OpCounters(now.calls, now.errors, now.wall_ns, now.inner_ns,
                                        now.bytes, now.keys)  # fmt: skip
            self.step_histograms[op] = now.hist
            now.max_ms = 0.0
            now.hist = LogHistogram()
        out["dataplane/step/wall_ms"] = total_ms
        if step_wall_ms:
            out["dataplane/step/frac_of_step"] = total_ms / step_wall_ms
        out["dataplane/step/outstanding_mb"] = self.outstanding_bytes / 2**20
        out["dataplane/step/peak_mb"] = self.peak_bytes / 2**20
        g = self.guard
        out["dataplane/step/guard/rows_checked_count"] = g.rows_checked
        out["dataplane/step/guard/mismatches_count"] = g.mismatches
        out["dataplane/step/guard/rows_unverified_count"] = g.rows_unverified
        out["dataplane/step/guard/fields_skipped_count"] = g.fields_skipped
        out["dataplane/step/guard/failures_count"] = g.failures
        self.guard = GuardCounters()
        out["dataplane/step/self/accounting_errors_count"] = self.accounting_errors
        out["dataplane/step/self/unsized_fields_count"] = self.unsized_fields
        out["dataplane/step/self/overhead_ms"] = overhead_ns / 1e6
        out["dataplane/step/self/step_host_ms"] = (time.perf_counter_ns() - start) / 1e6
        return out

    def _reconcile(self) -> None:
        """Drop bytes of keys the store no longer holds (a reader in another process
        cleared them): a writer that never clears must not leak outstanding bytes."""
        for partition, held in list(self._held.items()):
            try:
                live = len(self.inner.list_keys(partition))
            except Exception as e:
                self._accounting_failed("list_keys", e)
                continue
            if live < held[0]:
                self._release_count(partition, held[0] - live)


def cluster_step(
    metrics: dict[str, float],
    histograms: dict[str, LogHistogram] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """The cluster view of one step from every rank, in one gather.

    Counts, MB and wall times sum across ranks; step maxima, ``frac_of_step`` (the
    slowest process's data-plane share of the step) and ``peak_mb`` take the max. Per-rank
    percentiles do not merge; the ranks' latency histograms (``client.step_histograms``)
    do, by summing, and the cluster percentiles are computed from the merged one with
    the same sample gates, clamped to the cluster maximum.
    """
    payload = (metrics, {op: h.copy() for op, h in (histograms or {}).items()})
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, payload, group=group)  # cold path, once per step
    else:
        gathered = [payload]
    out: dict[str, float] = {}
    names = {n for m, _ in gathered for n in m}
    for name in sorted(names):
        values = [m[name] for m, _ in gathered if name in m]
        if _PERCENTILE.fullmatch(name.rsplit("/", 1)[-1]):
            continue  # per-rank percentiles: replaced from the merged histograms below
        keep_max = name.endswith(("/max_ms", "frac_of_step", "peak_mb"))
        out[name] = max(values) if keep_max else sum(values)
    merged: dict[str, LogHistogram] = {}
    for _, hists in gathered:
        for op, h in hists.items():
            merged[op] = merged[op].merge(h) if op in merged else h
    for op, h in merged.items():
        top = out.get(f"dataplane/step/{op}/max_ms", h.max)
        for q, v in h.percentiles_gated().items():
            out[f"dataplane/step/{op}/p{round(q * 100)}_ms"] = min(v, top) if top else v
    return out
