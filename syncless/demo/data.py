"""Byte-level text from the Python standard library's own source files.

Every Python install has them, so the demo needs no download. The corpus is the
``*.py`` files under the stdlib directory in a sorted walk (installed packages and
test suites left out), concatenated up to a size cap; the same Python version gives
the same bytes on every machine.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import torch

VOCAB_SIZE = 256  # bytes


_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def _stdlib_sources(root: Path) -> list[Path]:
    """The stdlib's .py files in a stable order, without descending into installed
    packages: walking site-packages is slow, and a concurrent pip install can remove
    directories under the walk."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=lambda e: None):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        found += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    return found


def stdlib_corpus(max_bytes: int) -> torch.Tensor:
    """Up to ``max_bytes`` of stdlib source as a uint8 tensor."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in _stdlib_sources(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    if len(blob) < 4096:
        raise RuntimeError(
            f"found only {len(blob)} bytes of Python source under {root}; "
            "the demo corpus needs the standard library's .py files"
        )
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


class BatchSampler:
    """Random windows of the corpus, identical for any split of the global batch.

    Step ``s`` draws ``global_batch`` window offsets from a generator seeded with
    ``(seed, s)``; rank ``r`` takes rows ``[r * batch, (r + 1) * batch)``. So a
    single process with the whole global batch sees exactly the rows that a
    data-parallel job sees across its ranks.
    """

    def __init__(
        self, corpus: torch.Tensor, seq_len: int, batch: int, rank: int, world_size: int, seed: int
    ) -> None:
        if corpus.numel() <= seq_len + 1:
            raise ValueError(f"corpus of {corpus.numel()} bytes is shorter than seq_len+1")
        self.corpus = corpus
        self.seq_len = seq_len
        self.batch = batch
        self.rank = rank
        self.world_size = world_size
        self.seed = seed

    def batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) int64 tensors of shape [batch, seq_len] for ``step``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        high = self.corpus.numel() - self.seq_len - 1
        starts = torch.randint(0, high, (self.batch * self.world_size,), generator=g)
        starts = starts[self.rank * self.batch : (self.rank + 1) * self.batch]
        idx = starts[:, None] + torch.arange(self.seq_len + 1)
        window = self.corpus[idx].long()
        return window[:, :-1], window[:, 1:]
