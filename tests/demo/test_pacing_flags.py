"""--ep-splits, --run-ahead, --fix-router and --expert-impl: clear errors, the default
modes, and what the fixed router routes."""

import pytest
import torch

from syncless.cli import main
from syncless.demo.config import preset
from syncless.demo.dispatch import LocalDispatcher
from syncless.demo.model import MoE, Router, fixed_routing
from syncless.guard import no_sync


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (
            ["--ep-splits", "eager"],
            "--ep-splits must be one of auto, drain, static, static-paced, lookahead",
        ),
        (["--ep-splits", "drain"], "add --expert-parallel"),
        (["--ep-splits", "static", "--fix-router"], "add --expert-parallel"),
        (["--ep-splits", "static-paced", "--expert-parallel"], "add --fix-router"),
        (["--run-ahead", "-1"], "--run-ahead must be >= 0"),
        (
            ["--ep-splits", "static", "--expert-parallel", "--fix-router", "--run-ahead", "4"],
            "--run-ahead applies to --ep-splits static-paced only",
        ),
        (["--run-ahead", "4"], "--run-ahead applies to --ep-splits static-paced only"),
        (["--expert-impl", "sparse"], "--expert-impl must be one of auto, grouped, padded, loop"),
        (["--capacity-factor", "-1"], "--capacity-factor must be >= 0"),
        (["--capacity-factor", "1.25"], "applies to --expert-impl padded only"),
    ],
)
def test_bad_pacing_flags(capsys, flags, fragment):
    assert main(["demo", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("syncless: error: ")
    assert fragment in err


def test_bad_pacing_flags_fail_before_the_ranks_start(capsys):
    assert main(["demo", "--nproc", "2", "--ep-splits", "static", "--expert-parallel"]) == 2
    assert "add --fix-router" in capsys.readouterr().err


def test_lookahead_needs_no_fixed_router():
    preset("tiny", expert_parallel=True, ep_splits="lookahead").validate(world_size=2)
    preset("tiny", expert_parallel=True, fix_router=True, ep_splits="static-paced",
           run_ahead=4).validate(world_size=2)  # fmt: skip


def test_the_default_split_mode_is_the_fastest_safe_one_for_the_router():
    learned = preset("tiny", expert_parallel=True)
    fixed = preset("tiny", expert_parallel=True, fix_router=True, run_ahead=4)
    for cfg in (learned, fixed):
        cfg.validate(world_size=2)  # no extra flag needed
    assert (learned.ep_splits, learned.ep_mode()) == ("auto", "lookahead")
    assert (fixed.ep_splits, fixed.ep_mode()) == ("auto", "static-paced")
    assert preset("tiny", expert_parallel=True, ep_splits="drain").ep_mode() == "drain"


def test_the_fixed_router_is_deterministic_balanced_and_input_independent():
    router = Router(d_model=8, n_experts=4, top_k=2, fixed=True)
    with no_sync():
        weights, experts, probs = router(torch.randn(6, 8))
        _, again, _ = router(torch.randn(6, 8))
    assert experts.tolist() == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1], [2, 3]]  # (t*k+j) % E
    assert torch.equal(again, experts)
    assert torch.equal(weights, torch.full((6, 2), 0.5))
    assert probs.shape == (6, 4)  # the gate still runs
    # 5 tokens, k=3, 7 experts: every expert used, loads differ by at most one.
    flat = fixed_routing(5, 3, 7, torch.device("cpu")).reshape(-1)
    counts = torch.zeros(7, dtype=torch.int64).index_add_(0, flat, torch.ones_like(flat))
    assert counts.sum() == 15 and counts.max() - counts.min() <= 1


def test_the_balance_loss_of_the_fixed_router_is_one():
    cfg = preset("tiny", fix_router=True)
    moe = MoE(cfg, LocalDispatcher())
    x = torch.randn(3, cfg.seq_len, cfg.d_model)
    _, balance = moe(x)
    # Every sequence spreads seq*k rows evenly over the experts: f_i = 1, so the loss
    # is sum_i P_i = 1, whatever the gate's probabilities.
    torch.testing.assert_close(balance, torch.tensor(1.0))


def test_a_single_process_demo_runs_with_the_fixed_router(tmp_path):
    argv = ["demo", "--fix-router", "--steps", "2", "--run-dir", str(tmp_path / "r"), "--quiet"]
    assert main(argv) == 0
