from syncless.cli import main
from syncless.run import open as open_run


def _census(run_dir, capsys, *flags):
    argv = ["demo", "--steps", "6", "--n-layers", "3", "--sync-census", "4",
            "--run-dir", str(run_dir), "--no-report", *flags]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    with open_run(run_dir) as store:
        _, per_step = store.query(
            "SELECT step, value FROM metrics WHERE name = 'guard/step/syncs_count' ORDER BY step"
        )
        _, per_site = store.query(
            "SELECT name, sum(value) FROM metrics WHERE name LIKE 'guard/site/%' "
            "GROUP BY name ORDER BY name"
        )
    return err, per_step, per_site


def test_the_default_demo_step_has_no_sync(tmp_path, capsys):
    # Ground truth from the demo's code: the experts get their counts on the device
    # (grouped GEMMs on CPU) and the loss is read a step late from pinned memory.
    err, per_step, per_site = _census(tmp_path / "run", capsys)
    assert "sync census: 0 syncs in 4 step(s)" in err
    assert per_step == [(1, 0.0), (2, 0.0), (3, 0.0), (4, 0.0)]  # steps 1..4: step 0 skipped
    assert per_site == []


def test_the_loop_experts_drain_the_counts_once_per_layer(tmp_path, capsys):
    err, per_step, per_site = _census(tmp_path / "run", capsys, "--expert-impl", "loop")
    assert "sync census: 12 syncs in 4 step(s)" in err
    assert per_step == [(1, 3.0), (2, 3.0), (3, 3.0), (4, 3.0)]  # one per MoE layer
    assert len(per_site) == 1
    ((experts, n),) = per_site
    assert experts.startswith("guard/site/syncless.demo.experts.") and n == 12


def test_sync_census_needs_a_positive_step_count(capsys):
    assert main(["demo", "--sync-census", "0"]) == 2
    assert "positive number of steps" in capsys.readouterr().err
