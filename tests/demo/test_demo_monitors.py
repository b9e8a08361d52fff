from syncless.cli import main
from syncless.run import open as open_run


def test_all_monitors_on_the_demo_add_no_sync_and_land_in_the_store(tmp_path, capsys):
    """With every monitor on, the census still sees exactly the demo's own syncs: none
    (ground truth from the demo's code: counts stay on the device, the loss is read a
    step late from pinned memory). A monitor hook that synced would add to that count."""
    run_dir = tmp_path / "run"
    argv = ["demo", "--steps", "6", "--n-layers", "3", "--monitors", "all", "--sync-census",
            "4", "--monitor-budget", "0", "--run-dir", str(run_dir)]  # fmt: skip
    assert main(argv) == 0
    assert "sync census: 0 syncs in 4 step(s)" in capsys.readouterr().err

    with open_run(run_dir) as store:
        _, rows = store.query(
            "SELECT name, count(DISTINCT step) FROM metrics WHERE name IN ("
            "'monitors/global/attn_qk_logit_max', 'monitors/global/moe_imbalance_mean', "
            "'monitors/global/act_absmax', 'monitors/step/nonfinite_alert_count', "
            "'monitors/global/param_norm') GROUP BY name ORDER BY name"
        )
        _, sites = store.query(
            "SELECT DISTINCT name FROM metrics WHERE name LIKE 'guard/site/%monitors%' "
            "OR name LIKE 'guard/site/%metrics%'"
        )
    # every monitor at its default cadence: 6 steps each, norms every 10 (step 0 only)
    assert rows == [
        ("monitors/global/act_absmax", 6),
        ("monitors/global/attn_qk_logit_max", 6),
        ("monitors/global/moe_imbalance_mean", 6),
        ("monitors/global/param_norm", 1),
        ("monitors/step/nonfinite_alert_count", 6),
    ]
    assert sites == []


def test_the_budget_sets_the_cadences_and_says_so(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["demo", "--steps", "5", "--n-layers", "2", "--monitors", "attention,norms",
            "--run-dir", str(run_dir)]  # fmt: skip
    assert main(argv) == 0
    assert "syncless monitors: budget 1.0% of a" in capsys.readouterr().err
    with open_run(run_dir) as store:
        _, rows = store.query(
            "SELECT name, min(value) FROM metrics WHERE name IN ("
            "'monitors/self/attention_every_steps', 'monitors/self/norms_every_steps', "
            "'monitors/self/budget_frac') GROUP BY name ORDER BY name"
        )
    cadence = dict(rows)
    assert cadence["monitors/self/budget_frac"] == 0.01
    # never faster than each monitor's own cadence (attention 1, norms 10)
    assert cadence["monitors/self/attention_every_steps"] >= 1
    assert cadence["monitors/self/norms_every_steps"] >= 10
    assert main(["demo", "--monitors", "all", "--monitor-budget", "2"]) == 2


def test_unknown_monitor_name(capsys):
    assert main(["demo", "--monitors", "attention,bogus"]) == 2
    assert "unknown monitor(s) 'bogus'" in capsys.readouterr().err
    assert main(["demo", "--monitor-every", "3"]) == 2
    assert "--monitor-every needs --monitors" in capsys.readouterr().err
