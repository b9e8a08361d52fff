import json
import math

from syncless.cli import main
from syncless.demo.config import preset
from syncless.demo.train import run_demo
from syncless.run import open as open_run


def test_tiny_demo_through_the_cli_learns_and_lands_in_the_store(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["demo", "--preset", "tiny", "--run-dir", str(run_dir), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(run_dir)

    assert main(["query", str(run_dir), "SELECT step, value FROM metrics "
                 "WHERE name = 'demo/step/loss' ORDER BY step", "--format", "json"]) == 0  # fmt: skip
    losses = [row["value"] for row in json.loads(capsys.readouterr().out)]
    assert len(losses) == 200
    # A fresh model predicts ~uniform bytes: loss ~ ln 256. After 200 steps it must be
    # far below that (the corpus is Python source: highly predictable bytes).
    assert abs(losses[0] - math.log(256)) < 0.5
    assert sum(losses[-20:]) / 20 < 0.6 * losses[0]

    with open_run(run_dir) as store:
        _, names = store.query("SELECT DISTINCT name FROM metrics ORDER BY name")
        assert [n for (n,) in names] == [
            "demo/step/balance_loss",
            "demo/step/grad_norm",
            "demo/step/loss",
            "demo/step/lr",
            "demo/step/step_ms",
            "demo/step/tokens_per_s",
        ]
        assert store.info["config"]["n_layers"] == 2
        assert store.info["world_size"] == 1


def test_same_seed_same_loss_curve(tmp_path):
    cfg = preset("tiny", steps=25)
    a = run_demo(cfg, run_dir=tmp_path / "a", quiet=True).losses
    b = run_demo(cfg, run_dir=tmp_path / "b", quiet=True).losses
    c = run_demo(preset("tiny", steps=25, seed=1), run_dir=tmp_path / "c", quiet=True).losses
    assert len(a) == 25
    assert a == b  # bit-identical on CPU
    assert a != c


def test_logged_steps_are_read_a_step_late_and_all_land(tmp_path):
    # steps 0..6, every 3rd logged and the last: each read after the next step is queued,
    # the last one after the loop.
    result = run_demo(preset("tiny", steps=7, log_every=3), run_dir=tmp_path / "r", quiet=True)
    assert [step for step, _ in result.losses] == [0, 3, 6]
    with open_run(tmp_path / "r") as store:
        _, rows = store.query(
            "SELECT step, value FROM metrics WHERE name = 'demo/step/step_ms' ORDER BY step"
        )
    assert [step for step, _ in rows] == [0, 3, 6]
    assert all(ms > 0 for _, ms in rows)
