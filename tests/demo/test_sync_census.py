from syncless.cli import main
from syncless.run import open as open_run


def test_sync_census_counts_the_dispatch_drains_and_the_loss_read(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = [
        "demo",
        "--steps",
        "6",
        "--n-layers",
        "3",
        "--sync-census",
        "4",
        "--run-dir",
        str(run_dir),
    ]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "sync census: 16 syncs in 4 step(s)" in err

    # Ground truth from the demo's code: one count drain (`.tolist()`) per MoE layer in
    # the local dispatcher and one loss read-back per logged step; nothing else syncs.
    with open_run(run_dir) as store:
        _, per_step = store.query(
            "SELECT step, value FROM metrics WHERE name = 'guard/step/syncs_count' ORDER BY step"
        )
        _, per_site = store.query(
            "SELECT name, sum(value) FROM metrics WHERE name LIKE 'guard/site/%' "
            "GROUP BY name ORDER BY name"
        )
    assert per_step == [(1, 4.0), (2, 4.0), (3, 4.0), (4, 4.0)]  # steps 1..4: step 0 skipped
    assert len(per_site) == 2
    (dispatch, n_dispatch), (train, n_train) = per_site
    assert dispatch.startswith("guard/site/syncless.demo.dispatch.") and n_dispatch == 12
    assert train.startswith("guard/site/syncless.demo.train.") and n_train == 4


def test_sync_census_needs_a_positive_step_count(capsys):
    assert main(["demo", "--sync-census", "0"]) == 2
    assert "positive number of steps" in capsys.readouterr().err
