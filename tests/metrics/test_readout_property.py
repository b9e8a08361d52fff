"""Property-based tests of the metric core's readout decoding.

``syncless.metrics.readout`` decodes a flush's packed host buffer with whole-array
numpy passes (slices, ``reduceat``, index stacks) chosen for speed: exactly the kind of
code whose edge cases hand-written tests miss (an empty schema, a region with no keys,
layers that do not sit back to back, a NaN or inf among the data). Hypothesis draws
random schemas through a real ``MetricSet`` and random buffer contents for them, and
every decoded value, presence flag, global over layers and step record is compared with
a plain reference decoder written here: per-element Python loops over what was
recorded, never over the buffer or the library's index arrays.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from syncless.metrics import Agg, Landed, MetricSet, Readout

# Summation order differs between the library (numpy's pairwise sums, reduceat) and
# the reference (left to right), so sums agree to rounding relative to the magnitude
# of their terms (Expected.scale), not to their possibly cancelled result.
RTOL = 1e-12

AREAS = ("fwd", "opt")
NAMES = ("act_mean", "grad-norm", "qk.max", "tokens_count")
ELEMENTS = ("i", "head", "expert")
AGGS: tuple[Agg, ...] = ("mean", "sum", "max", "min")

# Bounded so that no sum of a case's terms overflows: an overflow would depend on the
# summation order. inf is still drawn, as a recorded value.
ORDINARY = st.floats(min_value=-1e12, max_value=1e12)
SPECIALS = (math.nan, math.inf, -math.inf)
# A max that records -inf (a min that records +inf) leaves its identity, which the
# buffer cannot tell from nothing recorded, so it is never drawn as data.
IDENTITY = {"max": -math.inf, "min": math.inf}

SETTINGS = settings(max_examples=250, deadline=None, derandomize=True)


@dataclass(frozen=True)
class Metric:
    """One declared metric, as ``MetricSet.declare`` takes it."""

    area: str
    name: str
    agg: Agg
    size: int
    layer: int | None
    element: str
    emit_elements: bool
    derive_global: bool

    @property
    def key(self) -> str:
        scope = "step" if self.layer is None else f"layer_{self.layer:02d}"
        return f"{self.area}/{scope}/{self.name}"


# What one element received: None (nothing recorded), else (value, count) -- for
# mean/sum the accumulated sum of ``count`` samples, for max/min the extreme (count 1).
Recorded = tuple[float, int] | None


@dataclass(frozen=True)
class Case:
    metrics: tuple[Metric, ...]
    recorded: tuple[tuple[Recorded, ...], ...]  # per metric, per element


@dataclass(frozen=True)
class Expected:
    """A reference value and the magnitude of the terms it was summed from."""

    value: float
    scale: float


@dataclass(frozen=True)
class RefKey:
    """A key the reference expects in the readout, with its elements (None: absent)."""

    agg: str
    element: str
    emit_elements: bool
    elements: tuple[Expected | None, ...]


# -- strategies ---------------------------------------------------------------------

sizes = st.one_of(st.just(1), st.integers(2, 12))  # 11 and 12 give two-digit element names


@st.composite
def schemas(draw: st.DrawFn, layered: bool = False) -> tuple[Metric, ...]:
    """Any mix of step metrics and per-layer metric families (a name over some of the
    layers, one agg; one size, or sizes that differ across layers), or nothing.
    ``layered``: at least two layers, and families mostly over several of them."""
    shapes = ("layers", "both") if layered else ("empty", "step", "layers", "both")
    shape = draw(st.sampled_from(shapes))
    names = st.tuples(st.sampled_from(AREAS), st.sampled_from(NAMES))
    metrics: list[Metric] = []
    if shape in ("step", "both"):
        for area, name in draw(st.lists(names, min_size=1, max_size=4, unique=True)):
            metrics.append(
                Metric(
                    area,
                    name,
                    draw(st.sampled_from(AGGS)),
                    draw(sizes),
                    None,
                    draw(st.sampled_from(ELEMENTS)),
                    draw(st.booleans()),
                    draw(st.booleans()),  # no effect without layers
                )
            )
    if shape in ("layers", "both"):
        # Up to 120: "layer_100" sorts between "layer_10" and "layer_11", so a family's
        # layers need not sit back to back in the buffer.
        n_layers = 2 if layered else 1
        layers = draw(st.lists(st.integers(0, 120), min_size=n_layers, max_size=4, unique=True))
        for area, name in draw(st.lists(names, min_size=1, max_size=3, unique=True)):
            agg = draw(st.sampled_from(AGGS))
            element = draw(st.sampled_from(ELEMENTS))
            emit = draw(st.booleans())
            # Mostly on, and mostly one size: a global has the most paths to cover.
            derive = draw(st.sampled_from((True, True, False)))
            held = draw(st.lists(st.sampled_from(layers), min_size=n_layers, unique=True))
            one_size = draw(sizes) if draw(st.sampled_from((True, True, False))) else None
            for layer in held:
                size = one_size if one_size is not None else draw(sizes)
                metrics.append(Metric(area, name, agg, size, layer, element, emit, derive))
    # Declaration order must not matter.
    return tuple(draw(st.permutations(metrics)))


@st.composite
def cases(draw: st.DrawFn, layered: bool = False) -> Case:
    """A schema and what its elements recorded: all of them, none, or a random mix;
    with or without NaN and infinities among the values."""
    metrics = draw(schemas(layered))
    fill = draw(st.sampled_from(("mixed", "mixed", "full", "nothing")))
    with_specials = draw(st.booleans())
    recorded: list[tuple[Recorded, ...]] = []
    for m in metrics:
        specials = [x for x in SPECIALS if x != IDENTITY.get(m.agg)] if with_specials else []
        # One value in four from the specials (0.0 in cases without them): a NaN in
        # every key would hide the finite paths.
        values = st.one_of(ORDINARY, ORDINARY, ORDINARY, st.sampled_from(specials or [0.0]))
        row: list[Recorded] = []
        for _ in range(m.size):
            if fill == "nothing" or (fill == "mixed" and not draw(st.booleans())):
                row.append(None)
                continue
            count = draw(st.integers(1, 1000)) if m.agg in ("mean", "sum") else 1
            row.append((draw(values), count))
        recorded.append(tuple(row))
    return Case(metrics, tuple(recorded))


# Half the cases over several layers: globals over layers have the most paths.
any_case = st.one_of(cases(), cases(layered=True))


# -- the library under test ---------------------------------------------------------


def library_readout(case: Case, step: int = 7) -> Readout:
    """Declare and allocate the case's schema on CPU, write what each element recorded
    straight into a host buffer of the packed layout, and decode it as a flush would."""
    ms = MetricSet()
    for m in case.metrics:
        ms.declare(
            m.area,
            m.name,
            m.agg,
            size=m.size,
            layer=m.layer,
            element=m.element,
            emit_elements=m.emit_elements,
            derive_global=m.derive_global,
        )
    ms.allocate("cpu")
    assert ms.buffer is not None
    n_sum = sum(m.size for m in case.metrics if m.agg in ("mean", "sum"))
    n_max = sum(m.size for m in case.metrics if m.agg in ("max", "min"))
    host = np.zeros(ms.buffer.numel())
    written = np.zeros(host.size, dtype=bool)
    assert host.size == 2 * n_sum + n_max  # [sums | counts | maxima]
    for m, row in zip(case.metrics, case.recorded, strict=True):
        offsets = ms.slot(m.key).offsets
        assert offsets is not None
        s, c, x = offsets
        for i, rec in enumerate(row):
            if m.agg in ("mean", "sum"):
                assert s is not None and c is not None and c == s + n_sum
                host[s + i], host[c + i] = (0.0, 0.0) if rec is None else rec
                written[[s + i, c + i]] = True
            else:
                assert x is not None and x >= 2 * n_sum
                if rec is None:
                    host[x + i] = -math.inf
                else:
                    host[x + i] = -rec[0] if m.agg == "min" else rec[0]
                written[x + i] = True
    assert written.all()
    return ms.decode(Landed(step, host))


# -- the plain reference ------------------------------------------------------------


def plain_sum(xs: list[float]) -> float:
    total = 0.0
    for x in xs:
        total += x
    return total


def extreme(agg: str, xs: list[float]) -> Expected:
    """max or min, where one NaN makes the result NaN (as a device max does)."""
    if any(math.isnan(x) for x in xs):
        return Expected(math.nan, math.nan)
    value = max(xs) if agg == "max" else min(xs)
    return Expected(value, abs(value))


def element_value(agg: str, rec: Recorded) -> Expected | None:
    if rec is None:
        return None
    value, count = rec
    if agg == "mean":
        value = value / count
    return Expected(value, abs(value))


def over_layers(agg: str, present: list[tuple[float, int]]) -> Expected | None:
    """One element of a global over layers, from the layers that recorded it."""
    if not present:
        return None
    if agg in ("mean", "sum"):
        total = plain_sum([s for s, _ in present])
        scale = plain_sum([abs(s) for s, _ in present])
        if agg == "sum":
            return Expected(total, scale)
        # Count-weighted over every sample, never a mean of the layers' means.
        count = plain_sum([float(c) for _, c in present])
        return Expected(total / count, scale / count)
    return extreme(agg, [v for v, _ in present])


def reference_keys(case: Case) -> dict[str, RefKey]:
    """Every key the readout must hold: the declared ones and the globals over layers."""
    out: dict[str, RefKey] = {}
    for m, row in zip(case.metrics, case.recorded, strict=True):
        elements = tuple(element_value(m.agg, rec) for rec in row)
        out[m.key] = RefKey(m.agg, m.element, m.emit_elements, elements)
    families: dict[tuple[str, str], list[int]] = {}
    for i, m in enumerate(case.metrics):
        if m.layer is not None and m.derive_global:
            families.setdefault((m.area, m.name), []).append(i)
    for (area, name), parts in families.items():
        first = case.metrics[parts[0]]
        if any(case.metrics[p].size != first.size for p in parts):
            continue  # layers of different sizes have no elementwise global
        elements = []
        for e in range(first.size):
            present = [case.recorded[p][e] for p in parts]
            elements.append(over_layers(first.agg, [r for r in present if r is not None]))
        out[f"{area}/global/{name}"] = RefKey(
            first.agg, first.element, first.emit_elements, tuple(elements)
        )
    return out


def summary(agg: str, elements: tuple[Expected | None, ...]) -> Expected | None:
    """A key's record: over its present elements, a plain (unweighted) mean, a sum, or
    the extreme; None when no element has data."""
    present = [e for e in elements if e is not None]
    if not present:
        return None
    if agg in ("mean", "sum"):
        total = plain_sum([e.value for e in present])
        scale = plain_sum([e.scale for e in present])
        if agg == "mean":
            return Expected(total / len(present), scale / len(present))
        return Expected(total, scale)
    return extreme(agg, [e.value for e in present])


def reference_records(keys: dict[str, RefKey]) -> dict[str, Expected]:
    out: dict[str, Expected] = {}
    for key, ref in keys.items():
        s = summary(ref.agg, ref.elements)
        if s is not None:
            out[key] = s
        size = len(ref.elements)
        if size > 1 and ref.emit_elements:
            width = len(str(size - 1))
            for i, e in enumerate(ref.elements):
                if e is not None:
                    out[f"{key}/{ref.element}_{i:0{width}d}"] = e
    return out


# -- comparison ---------------------------------------------------------------------


def close(actual: float, expected: Expected) -> bool:
    """NaN equals NaN and an infinity itself; a finite value agrees to rounding."""
    actual = float(actual)
    if math.isnan(expected.value):
        return math.isnan(actual)
    if math.isinf(expected.value):
        return actual == expected.value
    # The floor: rounding among subnormals is absolute, not relative.
    tolerance = max(RTOL * expected.scale, sys.float_info.min)
    return math.isfinite(actual) and abs(actual - expected.value) <= tolerance


def assert_key_matches(readout: Readout, key: str, ref: RefKey) -> None:
    values, present, got = readout.values[key], readout.present[key], readout.get(key)
    assert got is not None
    assert values.shape == present.shape == got.shape == (len(ref.elements),), key
    for i, e in enumerate(ref.elements):
        assert bool(present[i]) == (e is not None), (key, i, e, values[i])
        if e is None:
            assert math.isnan(got[i]), (key, i, got[i])
        else:
            assert close(values[i], e), (key, i, values[i], e)
            assert close(got[i], e), (key, i, got[i], e)


# -- properties ---------------------------------------------------------------------

EMPTY = Case((), ())


@SETTINGS
@given(case=any_case)
@example(case=EMPTY)
def test_every_key_decodes_to_the_reference_values_and_presence(case: Case) -> None:
    readout = library_readout(case)
    keys = reference_keys(case)
    assert set(readout.values) == set(readout.present) == set(readout.specs) == set(keys)
    assert readout.step == 7
    assert readout.get("fwd/step/never_declared") is None
    for key, ref in keys.items():
        assert_key_matches(readout, key, ref)
    # stack(): one family's layers as rows, whether or not they sit back to back.
    families: dict[tuple[str, str], list[Metric]] = {}
    for m in case.metrics:
        if m.layer is not None:
            families.setdefault((m.area, m.name), []).append(m)
    for parts in families.values():
        if len({m.size for m in parts}) > 1:
            continue
        parts.sort(key=lambda m: m.layer or 0)
        values, present = readout.stack(tuple(m.key for m in parts))
        assert values.shape == present.shape == (len(parts), parts[0].size)
        for row, m in enumerate(parts):
            for i, e in enumerate(keys[m.key].elements):
                assert bool(present[row, i]) == (e is not None)
                assert e is None or close(values[row, i], e), (m.key, i, values[row, i], e)


@SETTINGS
@given(case=cases(layered=True))
def test_globals_over_layers_are_derived_as_the_reference_says(case: Case) -> None:
    """Only derive_global families whose layers have one size get ``area/global/name``;
    a mean is count-weighted over the present layers, a sum adds them, max/min take
    their extreme, and a NaN in a present layer propagates."""
    readout = library_readout(case)
    keys = reference_keys(case)
    global_keys = {k for k in keys if k.split("/")[1] == "global"}
    assert {k for k in readout.values if k.split("/")[1] == "global"} == global_keys
    for key in global_keys:
        assert_key_matches(readout, key, keys[key])


@SETTINGS
@given(case=any_case)
@example(case=EMPTY)
def test_records_are_one_summary_per_key_with_data_and_the_emitted_elements(
    case: Case,
) -> None:
    readout = library_readout(case, step=11)
    records = readout.records("run-a", 3, 1234.5)
    expected = reference_records(reference_keys(case))
    names = [r.name for r in records]
    assert len(names) == len(set(names)), "a record name appears twice"
    assert set(names) == set(expected)
    for r in records:
        assert (r.run, r.step, r.rank, r.time) == ("run-a", 11, 3, 1234.5)
        assert isinstance(r.value, float)
        assert close(r.value, expected[r.name]), (r.name, r.value, expected[r.name])


def test_an_empty_schema_decodes_to_an_empty_readout() -> None:
    """Nothing declared (a run whose monitors found nothing to watch) still flushes."""
    readout = library_readout(EMPTY)
    assert dict(readout.values) == {}
    assert list(readout.records("run-a", 0, 0.0)) == []
