"""WindowPattern validation and lookup, pattern versions, the packed boundary word."""

from __future__ import annotations

import numpy as np
import pytest

from syncless.capture import PatternVersions, WindowPattern, pack, unpack
from syncless.capture.windows import MAX_COUNTER, MAX_VERSION


def test_pattern_properties() -> None:
    p = WindowPattern(4, [(1, 2), [3, 4]])
    assert p.period == 4
    assert p.windows == ((1, 2), (3, 4))
    assert len(p) == 2
    assert p == WindowPattern(4, ((1, 2), (3, 4)))
    assert hash(p) == hash(WindowPattern(4, [(1, 2), (3, 4)]))
    assert p != WindowPattern(4, [(1, 2)])
    assert p != WindowPattern(8, [(1, 2), (3, 4)])
    assert repr(p) == "WindowPattern(4, [(1, 2), (3, 4)])"


def test_adjacent_windows_are_not_overlapping() -> None:
    # Half-open: [0, 2) and [2, 4) share no boundary phase.
    assert WindowPattern(4, [(0, 2), (2, 4)]).windows == ((0, 2), (2, 4))
    assert WindowPattern(1, [(0, 1)]).windows == ((0, 1),)
    assert WindowPattern(np.int64(3), [(np.int32(0), np.int64(1))]).period == 3


def test_locate() -> None:
    p = WindowPattern(4, [(1, 2), (3, 4)])
    # Phase 0 is critical, 1 is window 0, 2 critical, 3 window 1; then it recurs.
    expected = [
        (0, None),
        (0, 0),
        (0, None),
        (0, 1),
        (1, None),
        (1, 0),
        (1, None),
        (1, 1),
        (2, None),
        (2, 0),
    ]
    assert [tuple(p.locate(n)) for n in range(10)] == expected
    assert p.locate(4 * 10**12 + 3) == (10**12, 1)
    wide = WindowPattern(5, [(0, 3)])
    assert [wide.locate(n).position for n in range(6)] == [0, 0, 0, None, None, 0]
    with pytest.raises(ValueError, match="boundary counter must be >= 0"):
        p.locate(-1)


def test_bounds() -> None:
    p = WindowPattern(4, [(1, 2), (3, 4)])
    assert p.bounds(0, 0) == (1, 2)
    assert p.bounds(2, 1) == (11, 12)  # closes at boundary 0 of occurrence 3
    with pytest.raises(ValueError, match=r"positions 0\.\.1"):
        p.bounds(0, 2)


@pytest.mark.parametrize(
    ("period", "windows", "fragments"),
    [
        (0, [(0, 1)], ["period must be >= 1", "got 0", "boundaries the framework publishes"]),
        (-3, [(0, 1)], ["period must be >= 1", "got -3"]),
        (2.0, [(0, 1)], ["period must be an integer", "2.0"]),
        (True, [(0, 1)], ["period must be an integer", "bool"]),
        (4, [], ["windows is empty", "at least one", "suspend()"]),
        (4, None, ["windows must be a list of (begin, end) pairs"]),
        (4, [(1, 2, 3)], ["window 0 is (1, 2, 3)", "expected a (begin, end) pair"]),
        (4, [5], ["window 0 is 5", "expected a (begin, end) pair"]),
        (4, [(0, 1.5)], ["window 0 end must be an integer", "1.5"]),
        (4, [(2, 2)], ["window 0 is (2, 2)", "begin < end", "drop it"]),
        (4, [(3, 1)], ["window 0 is (3, 1)", "begin < end"]),
        (4, [(-1, 2)], ["window 0 is (-1, 2)", "0 <= begin < end <= period = 4"]),
        (8, [(0, 1), (6, 10)], ["window 1 is (6, 10)", "period = 8", "split in two"]),
        (8, [(4, 6), (0, 2)], ["sorted by begin", "window 1 (0, 2)", "sort them"]),
        (8, [(0, 4), (2, 6)], ["(0, 4) and window 1 (2, 6) overlap", "merge them into (0, 6)"]),
        (8, [(0, 6), (2, 4)], ["overlap", "merge them into (0, 6)"]),
    ],
)
def test_bad_patterns_are_rejected_clearly(period, windows, fragments) -> None:
    with pytest.raises(ValueError) as info:
        WindowPattern(period, windows)
    message = str(info.value)
    assert message.startswith("WindowPattern: ")
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_versions() -> None:
    versions = PatternVersions()
    assert (versions.version, versions.pattern) == (0, None)  # 0: no pattern yet
    a, b = WindowPattern(2, [(0, 1)]), WindowPattern(3, [(0, 1)])
    assert versions.define(a) == 1
    assert versions.define(WindowPattern(2, [(0, 1)])) == 1  # the same pattern again
    assert versions.define(b) == 2
    assert versions.pattern is b
    assert versions.define(a) == 3
    with pytest.raises(ValueError, match="expected a WindowPattern"):
        versions.define((2, [(0, 1)]))


def test_versions_wrap_within_16_bits_and_skip_zero() -> None:
    versions = PatternVersions()
    patterns = [WindowPattern(2, [(0, 1)]), WindowPattern(3, [(0, 1)])]
    seen = [versions.define(patterns[i % 2]) for i in range(MAX_VERSION + 2)]
    assert seen[:3] == [1, 2, 3]
    assert seen[MAX_VERSION - 1] == 0xFFFF
    assert seen[MAX_VERSION] == 1  # wrapped, 0 stays "no pattern"
    assert min(seen) == 1


def test_pack_unpack() -> None:
    for version, counter in [(0, 0), (1, 0), (7, 123456789), (0xFFFF, 2**48 - 1), (0x8000, 1)]:
        word = pack(version, counter)
        assert word == version * 2**48 + counter
        assert 0 <= word < 2**64
        assert unpack(word) == (version, counter)
    assert (MAX_VERSION, MAX_COUNTER) == (2**16 - 1, 2**48 - 1)


def test_unpack_accepts_the_int64_view() -> None:
    # The engine keeps the word in an int64 tensor: versions >= 0x8000 read back negative.
    word = pack(0xFFFF, 5)
    as_int64 = int(np.array([word], dtype=np.uint64).view(np.int64)[0])
    assert as_int64 < 0
    assert unpack(as_int64) == (0xFFFF, 5)
    as_int64 = int(np.array([pack(0x8000, 2**48 - 1)], dtype=np.uint64).view(np.int64)[0])
    assert unpack(as_int64) == (0x8000, 2**48 - 1)


@pytest.mark.parametrize(
    ("call", "fragment"),
    [
        (lambda: pack(2**16, 0), "pattern version must be in [0, 65535], got 65536"),
        (lambda: pack(-1, 0), "pattern version must be in [0, 65535]"),
        (lambda: pack(1, 2**48), "boundary counter must be in [0, 2**48 - 1]"),
        (lambda: pack(1, -1), "boundary counter must be in [0, 2**48 - 1]"),
        (lambda: pack(1.0, 0), "pattern version must be an integer"),
        (lambda: unpack(2**64), "boundary word must fit in 64 bits"),
        (lambda: unpack(-(2**63) - 1), "boundary word must fit in 64 bits"),
    ],
)
def test_pack_unpack_range_checks(call, fragment) -> None:
    with pytest.raises(ValueError) as info:
        call()
    assert fragment in str(info.value)
