"""``syncless compare`` (issue #48) on runs the test writes record by record, so every
answer is known beforehand: a baseline, a copy of it, and a run that leaves it at step
60 (loss, layer 2, a profile section) and then records a NaN and a spike."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from written_runs import unrelated_run, write_records

from syncless.cli import main
from syncless.errors import UsageError
from syncless.report.compare import compare

STEPS, RANKS, LAYERS, PARTS = 120, 2, 3, 60  # the third run parts at step 60


def loss(step: np.ndarray) -> np.ndarray:
    noise = np.random.default_rng(0).normal(0, 0.02, STEPS)  # one data order: same noise
    return 5 * np.exp(-step / 40) + 1 + noise[step]


def records(kind: str) -> dict[tuple[int, int, str], float]:
    """(step, rank, name) -> value of the run ``kind``: "base", "copy" or "parted"."""
    parted = kind == "parted"
    rng = np.random.default_rng(1)  # the monitors' values: the same in every run
    out: dict[tuple[int, int, str], float] = {}
    steps = np.arange(STEPS)
    values = loss(steps) + (parted & (steps >= PARTS)) * 0.5
    tokens = 1000 + rng.normal(0, 10, STEPS) - parted * 100
    for step in range(STEPS):
        for rank in range(RANKS):
            out[step, rank, "train/step/loss"] = float(values[step])
            out[step, rank, "train/step/tokens_per_s"] = float(tokens[step])
            out[step, rank, "train/step/step_ms"] = 100.0 + rank + parted * 10
        if step % 2 == 0:  # the monitors, on rank 0, every other step
            for layer in range(LAYERS):
                prefix = f"monitors/layer_{layer:02d}"
                act = 1 + layer + rng.normal(0, 0.01)
                if parted and layer == 2 and step >= PARTS:
                    act += 10.0
                if (layer, step) == (1, 32):
                    act = 9.0  # base's worst activation: layer 1, step 32
                out[step, 0, f"{prefix}/act_absmax"] = act
                out[step, 0, f"{prefix}/attn_entropy_nats"] = 3.0 - 0.5 * (layer == 0)
                out[step, 0, f"{prefix}/nonfinite_first_step"] = float("inf")  # a label: not ranked
        if step % 10 == 0:  # the profiler, every 10 steps, each rank
            for rank in range(RANKS):
                out[step, rank, "profile/forward/time_ms"] = 40.0 + parted * 5
                out[step, rank, "profile/backward/time_ms"] = 50.0 + parted * 0.5
                out[step, rank, "profile/step/time_ms"] = 100.0
    if parted:  # the alarms' records: step labels are values, read a step or more later
        out[71, 0, "monitors/step/nonfinite_first_step"] = 70.0
        out[71, 0, "monitors/step/nonfinite_first_layer"] = 2.0
        out[90, 0, "monitors/step/nonfinite_first_step"] = 89.0  # a later readout
        out[90, 0, "monitors/step/nonfinite_first_layer"] = 0.0
        out[75, 0, "monitors/step/loss_nonfinite_first_step"] = 74.0
        out[62, 0, "monitors/step/loss_spike_first_step"] = 61.0
        out[62, 0, "monitors/step/loss_spike_count"] = 1.0
        out[81, 0, "monitors/step/loss_spike_count"] = 2.0
        out[62, 0, "monitors/step/moved_first_step"] = 60.0
        out[62, 0, "monitors/step/moved_first_layer"] = 2.0
    return out


def write(path: Path, kind: str, lr: float) -> Path:
    config = {"lr": lr, "batch_size": 8, "opt": {"betas": [0.9, 0.95]}}
    info = {"name": f"run-{kind}", "world_size": RANKS, "config": config,
            "env": {"torch": "2.13.0", "git_commit": kind}}  # fmt: skip
    return write_records(path, records(kind), info)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("compare")
    return [str(write(root / "base", "base", 3e-4)), str(write(root / "copy", "copy", 3e-4)),
            str(write(root / "parted", "parted", 1e-3))]  # fmt: skip


def test_config_differences_name_the_keys_that_differ(runs):
    c = compare(runs)
    assert [r.id for r in c.runs] == ["base", "copy", "parted"]
    assert {d.key: d.values for d in c.config.differences} == {
        "lr": [3e-4, 3e-4, 1e-3],
        "env.git_commit": ["base", "copy", "parted"],
    }
    assert c.config.same == 4  # world_size, batch_size, opt.betas, env.torch


def test_loss_at_matching_steps_and_where_it_parts(runs):
    c = compare(runs)
    base, copy, parted = c.runs
    assert (base.loss, c.loss_bucket) == ("train/step/loss", 1)
    assert copy.divergence.first_different is None and copy.divergence.first_beyond_noise is None
    assert parted.divergence.first_different == PARTS
    assert parted.divergence.first_beyond_noise == PARTS
    assert parted.divergence.last_difference == pytest.approx(0.5)
    assert c.checkpoints == [0, 24, 48, 71, 95, 119]  # evenly over the matching steps
    truth = loss(np.array(c.checkpoints))
    np.testing.assert_allclose(base.loss_at, truth)
    np.testing.assert_allclose(parted.loss_at, truth + (np.array(c.checkpoints) >= PARTS) * 0.5)


def test_speed_is_the_median_over_steps_and_ranks(runs):
    c = compare(runs)
    for side, kind in zip(c.runs, ("base", "copy", "parted"), strict=True):
        vals = records(kind)
        tokens = [v for (_, _, n), v in vals.items() if n == "train/step/tokens_per_s"]
        step_ms = [v for (_, _, n), v in vals.items() if n == "train/step/step_ms"]
        assert side.speed["tokens_per_s"].median == pytest.approx(np.median(tokens))
        assert side.speed["tokens_per_s"].mean == pytest.approx(np.mean(tokens))
        assert side.speed["step_ms"].median == pytest.approx(np.median(step_ms))
        assert "mfu_frac" not in side.speed  # not recorded: not invented


def test_the_first_nan_and_spike_come_from_the_alarm_records(runs):
    base, _, parted = compare(runs).runs
    assert base.alarms.first() is None
    a = parted.alarms
    assert (a.output_step, a.output_layer) == (70, 2)  # the earliest label, its own layer
    assert (a.loss_step, a.loss_spike_step, a.loss_spikes) == (74, 61, 3)
    assert (a.moved_step, a.moved_layer) == (60, 2)
    assert a.grad_norm_spike_step is None and a.grad_norm_spikes is None  # older runs: none
    assert a.first() == (61, "loss spike")


def test_worst_layers_and_the_layer_that_moved_first(runs):
    c = compare(runs)
    base, copy, parted = c.runs
    assert (base.worst["act_absmax"].layer, base.worst["act_absmax"].value) == (1, 9.0)
    assert base.worst["act_absmax"].step == 32
    assert base.worst["attn_entropy_nats"].layer == 0  # the lowest is the worst there
    assert base.worst["attn_entropy_nats"].value == 2.5
    assert "nonfinite_first_step" not in base.worst  # a step label is not a value
    assert parted.worst["act_absmax"].layer == 2 and parted.worst["act_absmax"].value > 12
    assert copy.moved is None
    assert (parted.moved.step, parted.moved.layer, parted.moved.metric) == (
        PARTS, 2, "act_absmax"
    )  # fmt: skip


def test_the_profile_sections_that_changed_most_come_first(runs):
    c = compare(runs)
    top = c.sections[0]
    assert (top.section, top.run, top.base_ms, top.ms) == ("forward", "parted", 40.0, 45.0)
    assert top.change_ms == pytest.approx(5.0)
    assert [(s.section, s.run) for s in c.sections[:2]] == [("forward", "parted"),
                                                            ("backward", "parted")]  # fmt: skip
    assert all(s.change_ms == 0 for s in c.sections if s.run == "copy")


def test_the_table_names_every_answer(runs, capsys):
    assert main(["compare", *runs]) == 0
    out = capsys.readouterr().out
    for text in ("3 runs against the baseline base", "lr", "0.001", "train/step/loss",
                 "first differs", "beyond noise", "tokens/s", "-10.0%",
                 "step 61: loss spike", "layer 2, step 60", "act_absmax", "1: 9 @ 32",
                 "forward"):  # fmt: skip
        assert text in out, text


def test_json_holds_the_same_answers(runs, capsys):
    assert main(["compare", *runs, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    parted = doc["runs"][2]
    assert parted["divergence"]["first_beyond_noise"] == PARTS
    assert parted["moved"] == {"step": PARTS, "layer": 2, "metric": "act_absmax"}
    assert parted["alarms"]["loss_spike_step"] == 61
    assert doc["config"]["differences"][0] == {"key": "lr", "values": [3e-4, 3e-4, 1e-3]}


def test_a_folder_of_runs_compares_them_all_against_the_first(runs):
    root = str(Path(runs[0]).parent)
    assert [r.id for r in compare([runs[2], root]).runs] == ["parted", "base", "copy"]


def test_bad_input_is_one_line_that_says_what_to_do(runs, tmp_path, capsys):
    with pytest.raises(UsageError, match="two runs or more"):
        compare([runs[0]])
    other = unrelated_run(tmp_path / "other")
    with pytest.raises(UsageError, match=r"no metric in common.*other: eval/"):
        compare([runs[0], str(other)])
    assert main(["compare", runs[0], str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
