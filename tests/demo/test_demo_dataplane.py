from syncless.cli import main
from syncless.run import open as open_run


def test_demo_batches_through_the_store_with_exact_bytes_and_verified_rows(tmp_path):
    run_dir = tmp_path / "run"
    assert main(["demo", "--steps", "5", "--dataplane", "--run-dir", str(run_dir), "--quiet"]) == 0
    with open_run(run_dir) as store:
        _, rows = store.query(
            "SELECT name, min(value), max(value), count(*) FROM metrics "
            "WHERE name IN ('dataplane/step/put/mb', 'dataplane/step/get/mb', "
            "'dataplane/step/guard/rows_checked_count', 'dataplane/step/guard/mismatches_count', "
            "'dataplane/step/outstanding_mb', 'dataplane/step/put/calls_count') "
            "GROUP BY name ORDER BY name"
        )
        _, loss = store.query("SELECT count(*) FROM metrics WHERE name = 'demo/step/loss'")
    # Ground truth from the tiny preset: 8 sequences of 64 int64 tokens, inputs and
    # targets, per step; every row of both fields verified; cleared after each get.
    mb = 2 * 8 * 64 * 8 / 2**20
    assert rows == [
        ("dataplane/step/get/mb", mb, mb, 5),
        ("dataplane/step/guard/mismatches_count", 0.0, 0.0, 5),
        ("dataplane/step/guard/rows_checked_count", 16.0, 16.0, 5),
        ("dataplane/step/outstanding_mb", 0.0, 0.0, 5),
        ("dataplane/step/put/calls_count", 1.0, 1.0, 5),
        ("dataplane/step/put/mb", mb, mb, 5),
    ]
    assert loss == [(5,)]
