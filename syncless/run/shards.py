"""The metric shards of a run directory, and the manifest their names are.

A shard's name records what a reader needs to plan a query without opening it:

    metrics/rank00003-000001-000040.s0_4999.n2560000.parquet

is rank 3's writer sequence numbers 1 to 40 (a compacted shard; a shard as written
covers one number), steps 0 to 4999 and 2,560,000 rows. The name appears atomically
with the data (written under a temporary name and renamed, or one object PUT), so the
manifest can never disagree with the files: there is no second file to update, lose or
tear in a crash, and one directory listing is the whole plan.

Compaction (syncless.run.compact) writes a merged shard whose sequence range covers its
inputs, then deletes them. A reader keeps, per rank, only the shards no other shard's
range covers: a crash between the merged shard's rename and the inputs' deletion leaves
every record visible exactly once. Shards of earlier versions
(``rank00003-000007.parquet``) are read as one-number shards whose steps and rows are
unknown until their footer is read.

A shard may have a rollup beside it (syncless.run.rollups): the same name with
``.rollup`` for ``.parquet``. It summarizes that shard and nothing else, so the same
rule keeps it honest: a rollup counts only while the shard it names is visible; one
whose shard is covered or gone (a compaction killed between writing it and its shard,
or after deleting a shard before its rollup) is a stray that readers ignore and the
next compaction deletes.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from syncless.run.storage import RunPath, list_files

_NAME = re.compile(
    r"^rank(?P<rank>\d{5})-(?P<lo>\d{6,})"
    r"(?:-(?P<hi>\d{6,})\.s(?P<s0>-?\d+)_(?P<s1>-?\d+)\.n(?P<rows>\d+))?\.parquet$"
)


@dataclass(frozen=True, order=True)
class ShardName:
    """What a metric shard's name says. ``first_step``/``last_step``/``rows`` are
    ``None`` for a shard named before the manifest (read its footer)."""

    rank: int
    first_seq: int
    last_seq: int
    first_step: int | None = None
    last_step: int | None = None
    rows: int | None = None

    @property
    def name(self) -> str:
        if self.rows is None:
            return f"rank{self.rank:05d}-{self.first_seq:06d}.parquet"
        return (
            f"rank{self.rank:05d}-{self.first_seq:06d}-{self.last_seq:06d}"
            f".s{self.first_step}_{self.last_step}.n{self.rows}.parquet"
        )

    @property
    def compacted(self) -> bool:
        return self.last_seq > self.first_seq

    def covers(self, other: ShardName) -> bool:
        """Whether this shard holds ``other``'s records (a merge of its range)."""
        return (
            self.rank == other.rank
            and self != other
            and self.first_seq <= other.first_seq
            and other.last_seq <= self.last_seq
        )


def parse(name: str) -> ShardName | None:
    """The manifest of a shard file name; None for a file that is not a metric shard."""
    m = _NAME.match(name)
    if m is None:
        return None
    lo = int(m["lo"])
    if m["hi"] is None:
        return ShardName(int(m["rank"]), lo, lo)
    return ShardName(int(m["rank"]), lo, int(m["hi"]), int(m["s0"]), int(m["s1"]), int(m["rows"]))


#: The step bucket widths a rollup holds (syncless.run.rollups, which says why these):
#: 64, 256, 1,024, 4,096, 16,384, 65,536.
ROLLUP_WIDTHS = tuple(64 * 4**k for k in range(6))
#: What a rollup's name ends with, where its shard's ends with ``.parquet``: not a
#: Parquet name, so that versions before rollups, which read any other ``*.parquet`` of
#: the folder as a shard, pass it by.
ROLLUP_SUFFIX = ".rollup"


def rollup_name(shard: str) -> str:
    """The file name of the rollup of the shard named ``shard``."""
    return shard.removesuffix(".parquet") + ROLLUP_SUFFIX


def rollup_shard(name: str) -> str | None:
    """The shard the rollup file ``name`` summarizes; None for a file that is not a
    rollup (temporary files included)."""
    if name.startswith(".") or not name.endswith(ROLLUP_SUFFIX):
        return None
    shard = name.removesuffix(ROLLUP_SUFFIX) + ".parquet"
    return shard if parse(shard) is not None else None


def shard_name(rank: int, first_seq: int, last_seq: int, steps: Sequence[int], rows: int) -> str:
    """The file name of a shard of ``rows`` records over ``steps`` (min, max)."""
    return ShardName(rank, first_seq, last_seq, min(steps), max(steps), rows).name


@dataclass(frozen=True)
class Catalogue:
    """A listing of a metrics folder: the shards a reader reads (``visible``), the ones
    a merged shard covers (``covered``: deleted by the next compaction), the rollups of
    visible shards (``rollups``: shard name -> rollup name), rollups whose shard is
    covered or gone (``stray_rollups``: ignored, deleted by the next compaction), and
    files that are neither (``other``, temporary files included)."""

    visible: list[tuple[str, ShardName]]
    covered: list[tuple[str, ShardName]]
    other: list[str]
    rollups: dict[str, str] = field(default_factory=dict)
    stray_rollups: list[str] = field(default_factory=list)

    def by_rank(self) -> dict[int, list[tuple[str, ShardName]]]:
        """The visible shards per rank, in sequence order (built once)."""
        return self._by_rank[0]

    def covered_by_rank(self) -> dict[int, list[tuple[str, ShardName]]]:
        return self._by_rank[1]

    @functools.cached_property
    def _by_rank(self) -> tuple[dict[int, list], dict[int, list]]:
        out: tuple[dict[int, list], dict[int, list]] = ({}, {})
        for table, entries in zip(out, (self.visible, self.covered), strict=True):
            for entry in entries:
                table.setdefault(entry[1].rank, []).append(entry)
        return out


def catalogue(names: Iterable[str]) -> Catalogue:
    """Sort a folder's file names into visible shards, covered ones and the rest. Per
    rank, a shard is covered when another's sequence range contains it: the widest
    ranges are taken first, and a range inside one already taken is dropped."""
    parsed: dict[int, list[tuple[str, ShardName]]] = {}
    other: list[str] = []
    rollup_of: dict[str, str] = {}  # shard name -> its rollup's
    for name in names:
        shard = None if name.startswith(".") else parse(name)  # temporary files, locks
        if shard is not None:
            parsed.setdefault(shard.rank, []).append((name, shard))
        elif (summarized := rollup_shard(name)) is not None:
            rollup_of[summarized] = name
        else:
            other.append(name)
    visible: list[tuple[str, ShardName]] = []
    covered: list[tuple[str, ShardName]] = []
    for rank in sorted(parsed):
        # By first number, the widest first: a shard is covered iff its range ends at
        # or before the furthest end seen so far (ranges only nest, never cross).
        entries = sorted(parsed[rank], key=lambda e: (e[1].first_seq, -e[1].last_seq))
        reach = -1
        for entry in entries:
            if entry[1].last_seq <= reach:
                covered.append(entry)
            else:
                visible.append(entry)
                reach = entry[1].last_seq
    shown = {name for name, _ in visible}
    rollups = {shard: r for shard, r in rollup_of.items() if shard in shown}
    stray = sorted(r for shard, r in rollup_of.items() if shard not in shown)
    return Catalogue(visible, covered, sorted(other), rollups, stray)


def list_folder(folder: RunPath, rank: int | None = None) -> Catalogue:
    """The catalogue of ``folder`` (one listing; no file is opened), or of ``rank``'s
    shards alone (a writer's own: the other ranks' names are not parsed)."""
    return catalogue(list_files(folder, "" if rank is None else f"rank{rank:05d}-"))
