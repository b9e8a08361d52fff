"""Merge a run's small metric shards into few large ones, crash-safe.

A rank writes one shard per flush: 8,640 a day at the default 10 s, and a query pays
for each file it opens (about 0.3 ms a file in DuckDB's own reader on a 2-core CPU,
1.5 ms through the store before compaction: issue #37). Compaction merges each rank's
consecutive shards into files of about ``TARGET_ROWS`` rows, in row groups of DuckDB's
size and in the order the records were written, so that a query opens few files.

Crash safety comes from the names (syncless.run.shards): the merged shard is written
under a temporary name and renamed into place, its sequence range covering its inputs,
and only then are the inputs deleted. A reader ignores a shard another covers, so a
SIGKILL at any point leaves every record visible exactly once; the next compaction
deletes what a killed one left covered. One compactor per rank at a time: a lock file
per rank (``flock``, released when the process dies) keeps a background compactor and
``syncless compact`` from merging crossing ranges. In an object store, which has no
locks and no renames, the merged shard is one PUT and the lock an object created
only if absent (syncless.run.storage); a compactor killed while holding it leaves it
behind, and a lock older than ``STALE_LOCK_S`` is taken over.

Rollups (syncless.run.rollups): each merged shard gets one, written before the shard
(a kill in between leaves a stray rollup, which readers ignore); an input's rollup is
deleted before the input. ``syncless compact`` (:func:`compact_run`) also writes the
rollup of every visible shard that lacks one (the shards of a run compacted before
rollups, a large shard never merged, the last small ones) and deletes stray rollups, so
that afterwards a report reads every record through rollups. A live writer's own
compaction writes rollups only for what it merges (a few ms for 65,536 records).

Sizes: ``TARGET_ROWS`` = 2**20 rows is 8 row groups of 131,072 rows (DuckDB scans a row
group per thread; its own writer's default is 122,880) and about 4-8 MB on disk for
step records (names dictionary-encoded, values and steps in plain pages): large enough
that opening the file is a small part of reading it, small enough that a rank's day
(0.55 M records at 64 metrics a step) is one file and a merge holds one file in memory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from syncless.run.rollups import write_rollup
from syncless.run.rundir import METRICS_DIR, read_run_json
from syncless.run.shards import Catalogue, ShardName, list_folder, rollup_shard, shard_name
from syncless.run.storage import (
    RunPath,
    exists,
    is_remote,
    read_metadata,
    read_table,
    remove,
    run_path,
    write_exclusive,
    write_parquet,
)

__all__ = ["ROW_GROUP_ROWS", "TARGET_ROWS", "CompactStats", "compact_rank", "compact_run"]

TARGET_ROWS = 1 << 20
ROW_GROUP_ROWS = 1 << 17
#: An object store's compaction lock this old was left by a compactor that died: a
#: live one holds it for a merge of one rank (seconds; a day of a rank is one file).
STALE_LOCK_S = 600.0


@dataclass
class CompactStats:
    """What a compaction did: shard files before and after, rows rewritten, covered
    leftovers (shards and stray rollups) deleted, rollups written (of merged shards and
    of shards that lacked one), wall seconds, and ranks skipped because another compactor
    held their lock."""

    shards_before: int = 0
    shards_after: int = 0
    rows: int = 0
    removed: int = 0
    seconds: float = 0.0
    busy_ranks: int = 0
    failed: list[str] = dataclasses.field(default_factory=list)  # merges left undone, why
    rollups: int = 0

    def add(self, other: CompactStats) -> None:
        for field in ("shards_before", "shards_after", "rows", "removed", "busy_ranks",
                      "rollups"):  # fmt: skip
            setattr(self, field, getattr(self, field) + getattr(other, field))
        self.failed += other.failed


def compact_run(run_dir: str | os.PathLike, *, target_rows: int = TARGET_ROWS) -> CompactStats:
    """Compact every rank's shards of a run directory (``syncless compact RUN_DIR``),
    and give every visible shard its rollup."""
    start = time.perf_counter()
    folder = run_path(run_dir) / METRICS_DIR
    stats = CompactStats()
    # One listing for every rank (a listing per rank cost 75 s on 10,240 shards of 1,024
    # ranks): a live writer that merges a rank's shards after it holds that rank's lock,
    # and a merge whose input it took away fails and leaves the rest as they are.
    listing = list_folder(folder)
    for rank in sorted(listing.by_rank()):
        stats.add(compact_rank(folder, rank, target_rows=target_rows, listing=listing,
                               add_rollups=True))  # fmt: skip
    stats.seconds = time.perf_counter() - start
    return stats


def compact_rank(
    folder: RunPath,
    rank: int,
    *,
    target_rows: int = TARGET_ROWS,
    min_inputs: int = 2,
    listing: Catalogue | None = None,
    add_rollups: bool = False,
) -> CompactStats:
    """Merge ``rank``'s consecutive shards in ``folder`` into shards of about
    ``target_rows`` rows, each with its rollup; a run of fewer than ``min_inputs`` small
    shards is left. ``listing``: the folder's, taken already (else this rank's is taken
    now). ``add_rollups``: also write the rollup of every shard left without one."""
    start = time.perf_counter()
    stats = CompactStats()
    with _rank_lock(folder, rank) as held:
        if not held:
            stats.busy_ranks = 1
            return stats
        if listing is None:
            listing = list_folder(folder, rank)
        for name, _ in listing.covered_by_rank().get(rank, []):
            remove(folder / name)  # merged by a compaction killed before
            stats.removed += 1
        stats.removed += _remove_strays(folder, rank, listing)
        shards = listing.by_rank().get(rank, [])
        stats.shards_before = stats.shards_after = len(shards)
        todo = list(_plan([_known(folder, e) for e in shards], target_rows, min_inputs))
        merged: set[str] = set()
        while todo:
            group = todo.pop()
            try:
                rows, summed = _merge(folder, group, listing.rollups)
            except _Unreadable as bad:  # merge what lies on either side of it
                stats.failed.append(f"{group[bad.index][0]}: {bad.reason}")
                todo += [
                    g for g in (group[: bad.index], group[bad.index + 1 :]) if len(g) >= min_inputs
                ]
                continue
            except OSError as e:  # writing the merged shard: the inputs stay as they are
                stats.failed.append(f"{group[0][0]}..{group[-1][0]}: {e}")
                continue
            stats.rows += rows
            stats.rollups += summed
            stats.shards_after -= len(group) - 1
            merged.update(name for name, _ in group)
        if add_rollups:
            lacking = [n for n, _ in shards if n not in merged and n not in listing.rollups]
            stats.rollups += sum(_add_rollup(folder, name) for name in lacking)
    stats.seconds = time.perf_counter() - start
    return stats


def _remove_strays(folder: RunPath, rank: int, listing: Catalogue) -> int:
    """Delete ``rank``'s rollups whose shard is covered or gone (the caller holds the
    rank's lock, and has deleted the covered shards); the number deleted. A shard absent
    from an older listing may have been written since, with its rollup, by a compactor
    that held the lock then: such a rollup is kept."""
    prefix = f"rank{rank:05d}-"
    removed = 0
    for name in listing.stray_rollups:
        shard = rollup_shard(name)
        if name.startswith(prefix) and shard is not None and not exists(folder / shard):
            remove(folder / name)
            removed += 1
    return removed


def _add_rollup(folder: RunPath, name: str) -> bool:
    """Write the rollup of the shard ``name``; False where it cannot be read (the store
    reads it, or skips it, record by record) or its rollup cannot be written."""
    try:
        return write_rollup(folder, name, read_table(folder / name)) is not None
    except (OSError, pa.ArrowException):
        return False


def _known(folder: RunPath, entry: tuple[str, ShardName]) -> tuple[str, ShardName]:
    """A shard named before the manifest, with its rows and steps from its footer (a
    shard that cannot be read keeps ``rows=None`` and is never merged)."""
    name, shard = entry
    if shard.rows is not None:
        return entry
    try:
        meta = read_metadata(folder / name)
        step = meta.schema.names.index("step")
        stats = [meta.row_group(i).column(step).statistics for i in range(meta.num_row_groups)]
        if not all(s is not None and s.has_min_max for s in stats) or not stats:
            return entry
        lo, hi = min(s.min for s in stats), max(s.max for s in stats)
    except (OSError, ValueError, pa.ArrowException):
        return entry
    return name, ShardName(rank=shard.rank, first_seq=shard.first_seq, last_seq=shard.last_seq,
                           first_step=int(lo), last_step=int(hi), rows=meta.num_rows)  # fmt: skip


def _plan(
    shards: list[tuple[str, ShardName]], target_rows: int, min_inputs: int
) -> Iterator[list[tuple[str, ShardName]]]:
    """Runs of consecutive small shards (contiguous sequence numbers, each below the
    target), cut when they reach the target. A gap (a shard lost or unreadable) or a
    large shard ends a run: a merged range must cover only what it merged."""
    run: list[tuple[str, ShardName]] = []
    rows = 0

    def done() -> Iterator[list[tuple[str, ShardName]]]:
        if len(run) >= min_inputs:
            yield list(run)

    for entry in shards:
        shard = entry[1]
        small = shard.rows is not None and shard.rows < target_rows
        follows = bool(run) and shard.first_seq == run[-1][1].last_seq + 1
        if run and not (small and follows):
            yield from done()
            run, rows = [], 0
        if not small:
            continue
        run.append(entry)
        rows += shard.rows  # type: ignore[operator]
        if rows >= target_rows:
            yield from done()
            run, rows = [], 0
    yield from done()


def _merge(
    folder: RunPath, group: list[tuple[str, ShardName]], rollups: dict[str, str]
) -> tuple[int, bool]:
    """Write the merged shard of ``group`` and its rollup, then delete the inputs and
    theirs (``rollups``: shard name -> rollup name); the rows written, and whether a
    rollup was."""
    # Concatenated in sequence order, not sorted: the rows stay in the order they were
    # written, which the trace's nesting and the summary's name order read (and which
    # keeps each row group's steps a narrow range, for step filters).
    tables = []
    for i, (name, _) in enumerate(group):
        try:
            tables.append(read_table(folder / name))
        except (OSError, pa.ArrowException) as e:
            raise _Unreadable(i, str(e).splitlines()[0] if str(e) else type(e).__name__) from e
    table = pa.concat_tables(tables)
    steps = pc.min_max(table["step"])
    first, last = group[0][1], group[-1][1]
    name = shard_name(
        first.rank, first.first_seq, last.last_seq,
        (steps["min"].as_py(), steps["max"].as_py()), table.num_rows,
    )  # fmt: skip
    # The rollup first: a kill before the shard is renamed into place leaves a stray
    # rollup (ignored: its shard is not there), never a shard counted twice.
    summary = write_rollup(folder, name, table)
    try:
        write_parquet(table, folder / name, row_group_size=ROW_GROUP_ROWS)
    except OSError:
        if summary is not None:
            remove(folder / summary)
        raise
    for old, _ in group:  # a kill from here on leaves them covered, not doubled
        if old in rollups:
            remove(folder / rollups[old])
        remove(folder / old)
    return table.num_rows, summary is not None


class _Unreadable(Exception):
    """Input ``index`` of a merge could not be read (it stays, and the store skips it)."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index, self.reason = index, reason


@contextlib.contextmanager
def _rank_lock(folder: RunPath, rank: int) -> Iterator[bool]:
    """Hold ``rank``'s compaction lock if no one else does (yields whether it got it)."""
    path = folder / f".compact-rank{rank:05d}.lock"
    if is_remote(path):
        with _object_lock(path) as held:
            yield held
        return
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def _object_lock(path: RunPath) -> Iterator[bool]:
    """An object store's lock: an object created only if absent, deleted on release."""
    body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()})
    for attempt in range(2):
        try:
            write_exclusive(path, body.encode())
            break
        except FileExistsError:
            if attempt or not _stale(path):
                yield False
                return
            remove(path)  # its holder died: take it over
    try:
        yield True
    finally:
        remove(path)


def _stale(lock: RunPath) -> bool:
    try:
        taken = json.loads(lock.read_text())["time"]
    except FileNotFoundError:
        return True  # released meanwhile
    except (OSError, ValueError, KeyError, TypeError):
        return False  # unreadable now: leave it to its holder
    return time.time() - float(taken) > STALE_LOCK_S


def run(args: argparse.Namespace) -> int:
    """``syncless compact RUN_DIR``: one line of what it did; exit 1 if a merge failed."""
    read_run_json(args.run_dir)  # a UsageError for what is not a run directory
    stats = compact_run(args.run_dir)
    print(
        f"syncless compact: {stats.shards_before} shards -> {stats.shards_after} "
        f"({stats.rows:,} records rewritten, {stats.removed} leftovers of an earlier "
        f"compaction removed, {stats.rollups} rollups written) in {stats.seconds:.1f} s"
    )
    for failure in stats.failed:
        print(f"syncless compact: left as they are: {failure}", file=sys.stderr)
    if stats.busy_ranks:
        print(f"syncless compact: {stats.busy_ranks} rank(s) skipped: another compaction "
              "holds their lock (the run's own, while it is alive)", file=sys.stderr)  # fmt: skip
    return 1 if stats.failed else 0
