"""Every monitor on every model (issue #36): a generated matrix, not a hand list.

Cells: monitor sets x model families (tests/monitors/matrix_models.py) x {eager,
activation checkpointing, compiled} x {1 rank, 2 gloo ranks}. Each cell attaches the
set as a user would (``attach(model, build(names, optimizer=opt))``, the default budget
and readout), trains a few steps and closes. It must either record what applies, with
the monitors that find nothing to watch named in one line and recording nothing, or
raise a clear ``UsageError`` at attach; never an exception later, and no failure
counted inside syncless (``monitors/self/errors_count`` stays 0).

The monitor sets are every single monitor, every pair and ``all`` in eager mode (a pair
is where two monitors share a read, a cadence plan or an empty schema); under
checkpointing and compile, and on 2 ranks, every single monitor and ``all``, which
between them reach every monitor's hooks in that mode (what differs from eager is how
the hooks are reached, not how monitors combine). Ground truth per cell comes from the
family's structure, not from an adapter: which layers have attention and a router, the
tokens a step routes (k per token, summed over ranks) and the layers' parameter norms
recomputed from their blocks (SGD at lr 0 keeps the parameters fixed). Eager and
checkpointed cells run every hook under ``no_sync()`` (HookGuard); compiled cells
cannot (no_sync itself is not traceable: test_compile_hf and the torchtitan tests check
those graphs).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import math
from dataclasses import dataclass, field

import pytest
import torch
from hook_guard import HookGuard, optimizer_hook_ids
from matrix_models import Family, build_checkpointed, families

from syncless.monitors import attach, build
from syncless.monitors.registry import MONITORS
from syncless.testing import spawn_gloo

STEPS = 2
FAMILIES = families()
SINGLES = [(m,) for m in MONITORS]
PAIRS = list(itertools.combinations(MONITORS, 2))
EVERY_SET = [*SINGLES, *PAIRS, ("all",)]
FEW_SETS = [*SINGLES, ("all",)]
# What each monitor records per layer, and what none of the others records.
# How each monitor's per-layer records start (prefixes: the gradients monitor's
# grad_out_nonfinite_count is not the nonfinite monitor's)
MARKERS = {
    "attention": "attn_",
    "moe": "moe_",
    "activations": "act_",
    "nonfinite": "nonfinite",
    "norms": "param_norm",
    "gradients": "grad_out_",
}


@pytest.fixture(autouse=True)
def kernel_backend(monkeypatch):
    """The torch kernels: the Triton path's grouped launches are tested per monitor
    under both backends (tests/monitors/conftest.py); the matrix is about which model
    meets which monitor."""
    from syncless import kernels

    monkeypatch.setenv("SYNCLESS_KERNELS", "torch")
    previous = kernels.backend()
    kernels.set_backend("torch")
    yield "torch"
    kernels.set_backend(previous)


def _names(monitors: tuple[str, ...]) -> list[str]:
    return list(MONITORS) if monitors == ("all",) else list(monitors)


@dataclass
class Cell:
    """What one cell saw, picklable from a spawned rank."""

    records: dict[str, float] = field(default_factory=dict)  # step 0's, by name
    idle: dict[str, str] = field(default_factory=dict)
    errors: int = 0
    stderr: str = ""
    norms: list[float] = field(default_factory=list)  # each layer's, recomputed
    raised: str | None = None  # a spawned rank's traceback


def run_cell(
    family: Family, monitors: tuple[str, ...], mode: str, rank: int = 0, world: int = 1
) -> Cell:
    cell = Cell()
    err = io.StringIO()
    with family.world(), contextlib.redirect_stderr(err):
        torch._dynamo.reset()
        model = build_checkpointed(family) if mode == "checkpointed" else family.build()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        guard = HookGuard()
        guard.snapshot(model)
        before = optimizer_hook_ids(opt)
        handle = attach(model, build(_names(monitors), optimizer=opt))
        # the optimizer's hooks (norms) run outside any graph: guarded in every mode
        wrapped = guard.guard_optimizer(opt, before)
        if mode != "compiled":
            wrapped += guard.guard(model)
        assert (
            wrapped > 0
            or not handle.monitors
            or (mode == "compiled" and "norms" not in _names(monitors))
        )
        call = family.compile(model) if mode == "compiled" else model
        records = []
        with family.dynamo() if mode == "compiled" else contextlib.nullcontext():
            for step in range(STEPS):
                loss = family.loss(call, 1000 * rank + step)
                loss.backward()
                opt.step()
                opt.zero_grad()
                checked = {"loss": loss.detach()} if handle.nonfinite is not None else {}
                records += handle.step(step, **checked)
        records += handle.close()
        cell.records = {r.name: r.value for r in records if r.step == 0}
        cell.idle = dict(handle.idle)
        cell.errors = handle.failures.total
        with torch.no_grad():
            cell.norms = [
                math.sqrt(sum(float(p.double().square().sum()) for p in block.parameters()))
                for block in family.blocks(model)
            ]
    cell.stderr = err.getvalue()
    return cell


def check_cell(family: Family, monitors: tuple[str, ...], cell: Cell, world: int = 1) -> None:
    names = _names(monitors)
    assert cell.errors == 0, cell.stderr
    applies = {
        "attention": bool(family.attention_layers),
        "moe": bool(family.moe_layers),
        "activations": True,
        "nonfinite": True,
        "norms": True,
        "gradients": True,
    }
    if any(applies[n] for n in names):  # else nothing is flushed, so nothing recorded
        assert cell.records.get("monitors/self/errors_count") == 0.0
    else:
        assert not cell.records
    idle = sorted(n for n in names if not applies[n])
    assert sorted(cell.idle) == idle
    if idle:  # one line, naming each
        (line,) = [x for x in cell.stderr.splitlines() if "nothing to watch" in x]
        assert all(n in line for n in idle)
    else:
        assert "nothing to watch" not in cell.stderr
    layer_records = [
        n for n in cell.records if n.startswith(("monitors/layer_", "monitors/global"))
    ]
    for name in MONITORS:
        recorded = [n for n in layer_records if n.split("/")[2].startswith(MARKERS[name])]
        if name not in names or not applies[name]:
            assert not recorded, f"{name} recorded {recorded[:3]}"
    layers = range(family.n_layers)
    at = "monitors/layer_{:02d}/{}".format
    if "attention" in names and applies["attention"]:
        for i in layers:
            present = at(i, "attn_qk_logit_max") in cell.records
            assert present == (i in family.attention_layers)
            if present:
                assert math.isfinite(cell.records[at(i, "attn_qk_logit_max")])
    if "moe" in names and applies["moe"]:
        for i in layers:
            count = cell.records.get(at(i, "moe_tokens_count"))
            want = family.tokens * family.top_k * world if i in family.moe_layers else None
            assert count == want, f"layer {i}"
    if "activations" in names:
        for i in layers:
            value = cell.records[at(i, "act_absmax")]
            assert math.isfinite(value) and value > 0
    if "nonfinite" in names:
        for i in layers:
            assert cell.records[at(i, "nonfinite_count")] == 0
        assert cell.records["monitors/step/loss_nonfinite_count"] == 0
    if "gradients" in names:
        for i in layers:
            rms, peak = cell.records[at(i, "grad_out_rms")], cell.records[at(i, "grad_out_absmax")]
            assert 0 < rms <= peak and math.isfinite(peak), f"layer {i}: rms {rms}, max {peak}"
            assert cell.records[at(i, "grad_out_nonfinite_count")] == 0
    if "norms" in names:
        got = [cell.records[at(i, "param_norm")] for i in layers]
        assert got == pytest.approx(cell.norms, rel=1e-5)


def _one_rank_cells() -> list:
    cells = []
    for name in FAMILIES:
        for mode in ("eager", "checkpointed", "compiled"):
            for monitors in EVERY_SET if mode == "eager" else FEW_SETS:
                cells.append(
                    pytest.param(name, monitors, mode, id=f"{name}-{mode}-{'+'.join(monitors)}")
                )
    return cells


@pytest.mark.parametrize(("family", "monitors", "mode"), _one_rank_cells())
def test_one_rank(family, monitors, mode):
    f = FAMILIES[family]
    check_cell(f, monitors, run_cell(f, monitors, mode))


# -- 2 gloo ranks: one spawn runs every family's cells -------------------------------------

# Per family on 2 ranks: every single monitor eagerly, and all of them checkpointed and
# compiled (what 2 ranks add is the cross-rank agreement and the reduced values; the
# hooks are the 1-rank cells').
TWO_RANK_CELLS = [
    *((monitors, "eager") for monitors in FEW_SETS),
    (("all",), "checkpointed"),
    (("all",), "compiled"),
]


def _cells_on_rank(rank: int, world: int) -> dict:
    """Every family's 2-rank cells on this rank; a cell that raises is kept as its
    traceback, so that one cell's failure does not hide the others'."""
    import traceback

    from syncless import kernels

    kernels.set_backend("torch")
    out = {}
    for name, family in families().items():
        for monitors, mode in TWO_RANK_CELLS:
            try:
                out[name, monitors, mode] = run_cell(family, monitors, mode, rank, world)
            except Exception:
                out[name, monitors, mode] = Cell(raised=traceback.format_exc())
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return spawn_gloo(_cells_on_rank, 2, timeout_s=900)


@pytest.mark.dist
@pytest.mark.parametrize(
    ("family", "monitors", "mode"),
    [
        pytest.param(f, m, mode, id=f"{f}-{mode}-{'+'.join(m)}")
        for f in FAMILIES
        for m, mode in TWO_RANK_CELLS
    ],
)
def test_two_ranks(family, monitors, mode, two_ranks):
    zero, one = (rank[family, monitors, mode] for rank in two_ranks)
    assert zero.raised is None and one.raised is None, zero.raised or one.raised
    check_cell(FAMILIES[family], monitors, zero, world=2)
    # every rank left out the same monitors (a flush of other monitors would hang)
    assert one.idle.keys() == zero.idle.keys()
    assert one.errors == 0
