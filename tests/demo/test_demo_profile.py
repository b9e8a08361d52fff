import subprocess
import sys

import pytest

from syncless.cli import main
from syncless.run import open as open_run


def _values(run_dir, like):
    with open_run(run_dir) as store:
        _, rows = store.query(
            f"SELECT name, step, value FROM metrics WHERE name LIKE '{like}' ORDER BY name, step"
        )
    return rows


def test_demo_profile_sections_and_exact_calls(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["demo", "--steps", "8", "--n-layers", "3", "--profile", "events",
            "--profile-every", "4", "--run-dir", str(run_dir)]  # fmt: skip
    assert main(argv) == 0
    assert "profile: 4 step(s)" in capsys.readouterr().err
    calls = {(n, s): v for n, s, v in _values(run_dir, "profile/%/calls_count")}
    # Ground truth from the demo's structure: one attention, router and experts module
    # per layer, one forward per step.
    for step in (3, 7):
        assert calls[("profile/attention/calls_count", step)] == 3
        assert calls[("profile/router/calls_count", step)] == 3
        assert calls[("profile/experts/calls_count", step)] == 3
        assert calls[("profile/forward/calls_count", step)] == 1
        assert calls[("profile/optimizer/calls_count", step)] == 1
    times = {(n, s): v for n, s, v in _values(run_dir, "profile/%/time_ms")}
    for step in (3, 7):
        parts = sum(times[(f"profile/{p}/time_ms", step)] for p in
                    ("data", "forward", "backward", "grad_sync", "optimizer", "log"))  # fmt: skip
        # the top-level phases cover the step but for the loop's own bookkeeping
        assert 0.8 * times[("profile/step/time_ms", step)] <= parts
        assert parts <= times[("profile/step/time_ms", step)] * 1.001


@pytest.mark.dist
def test_demo_profile_splits_expert_parallel_collectives(tmp_path):
    run_dir = tmp_path / "ep"
    proc = subprocess.run(
        [sys.executable, "-m", "syncless.cli", "demo", "--nproc", "2", "--expert-parallel",
         "--batch-size", "4", "--steps", "4", "--n-layers", "2", "--profile", "events",
         "--profile-every", "4", "--run-dir", str(run_dir), "--quiet"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    calls = {n: v for n, s, v in _values(run_dir, "profile/moe_%/calls_count") if s == 3}
    # per step: 2 layers x (counts exchange, dispatch, combine) forward, and the
    # dispatch and combine backward
    for name in ("moe_counts", "moe_dispatch", "moe_combine", "moe_dispatch_bwd",
                 "moe_combine_bwd"):  # fmt: skip
        assert calls[f"profile/{name}/calls_count"] == 2
    names = {n for n, _, _ in _values(run_dir, "profile/moe_dispatch/%")}
    assert {"profile/moe_dispatch/rendezvous_ms", "profile/moe_dispatch/transfer_ms",
            "profile/moe_dispatch/enqueue_ms"} <= names  # fmt: skip


def test_bad_profile_mode(capsys):
    assert main(["demo", "--profile", "fast"]) == 2
    assert "expected one of off, events, collectives, sync" in capsys.readouterr().err


def test_routing_trace_matches_a_recomputation(tmp_path):
    """With lr 1e-30 the weights never move (the update is below a float32 ulp), and
    with ``--balance aux`` no router bias does, so step s's routing ids can be
    recomputed from a fresh model and step s's batch: the trace must hold exactly
    those ids."""
    import numpy as np
    import torch

    from syncless.demo.config import preset
    from syncless.demo.data import BatchSampler, stdlib_corpus
    from syncless.demo.model import MoETransformer, init_weights

    run_dir = tmp_path / "run"
    argv = ["demo", "--steps", "3", "--lr", "1e-30", "--weight-decay", "0", "--balance", "aux",
            "--profile", "events", "--profile-trace", "--run-dir", str(run_dir), "--quiet"]  # fmt: skip
    assert main(argv) == 0
    cfg = preset("tiny", balance="aux")
    model = MoETransformer(cfg)
    init_weights(model, cfg.seed)
    sampler = BatchSampler(
        stdlib_corpus(int(cfg.corpus_mb * 2**20)), cfg.seq_len, cfg.batch_size, 0, 1, cfg.seed
    )
    routed: dict[int, torch.Tensor] = {}
    hooks = [
        block.moe.router.register_forward_hook(
            lambda _m, _a, out, i=i: routed.__setitem__(i, out[1].clone())
        )
        for i, block in enumerate(model.layers)
    ]
    files = sorted((run_dir / "trace" / "routing" / "rank00000").glob("step_*.npz"))
    assert [f.name for f in files] == [f"step_{s:07d}.npz" for s in range(3)]
    for step, path in enumerate(files):
        with torch.no_grad():
            model(sampler.batch_at(step)[0])
        traced = np.load(path)
        assert sorted(traced.files) == ["layer_00", "layer_01"]
        for i in range(2):
            np.testing.assert_array_equal(traced[f"layer_{i:02d}"], routed[i].numpy())
    for h in hooks:
        h.remove()


@pytest.mark.dist
def test_profile_trace_splits_dispatch_collectives_per_layer(tmp_path):
    run_dir = tmp_path / "ep"
    proc = subprocess.run(
        [sys.executable, "-m", "syncless.cli", "demo", "--nproc", "2", "--expert-parallel",
         "--batch-size", "4", "--steps", "3", "--n-layers", "2", "--profile", "events",
         "--profile-trace", "--run-dir", str(run_dir), "--quiet"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [r for r in _values(run_dir, "profile/moe_dispatch_l%/calls_count")
            if "_bwd" not in r[0]]  # fmt: skip
    # every step reported, one dispatch per layer per step
    assert sorted({(n, s) for n, s, _ in rows}) == [
        (f"profile/moe_dispatch_l{layer:02d}/calls_count", step)
        for layer in (0, 1)
        for step in range(3)
    ]
    assert all(v == 1 for _, _, v in rows)
    assert len(list((run_dir / "trace" / "routing" / "rank00001").glob("step_*.npz"))) == 3
