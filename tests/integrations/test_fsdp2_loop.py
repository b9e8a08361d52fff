"""examples/fsdp2_loop.py on 2 gloo ranks: FSDP2 + non-reentrant activation
checkpointing + torch.compile (aot_eager: graph capture without a C++ compiler) +
gradient accumulation, every monitor attached (issue #20)."""

from __future__ import annotations

import pytest
from integration_helpers import load_example

from syncless.run import open as open_run
from syncless.testing import spawn_gloo

pytest.importorskip("transformers")


def _rank(rank: int, world: int, run_dir: str) -> str:
    return load_example("fsdp2_loop").main(
        ["--compile-backend", "aot_eager", "--run-dir", run_dir, "--steps", "3"]
    )


@pytest.mark.dist
@pytest.mark.slow
def test_the_fsdp2_checkpointed_compiled_loop_records_every_monitor(tmp_path):
    run_dir = str(tmp_path / "run")
    assert spawn_gloo(_rank, 2, run_dir, timeout_s=300) == [run_dir, run_dir]
    with open_run(run_dir) as store:
        _, rows = store.query(
            "SELECT name, count(DISTINCT step), max(value) FROM metrics WHERE name IN ("
            "'monitors/layer_01/param_norm', 'monitors/layer_01/grad_norm', "
            "'monitors/global/attn_qk_logit_max', 'monitors/global/act_absmax', "
            "'monitors/self/attention_recompute_skipped_count') GROUP BY name"
        )
    found = {name: (steps, top) for name, steps, top in rows}
    # step 0 at the fastest cadences; the budget (default on) may slow them after that
    assert 1 <= found["monitors/global/attn_qk_logit_max"][0] <= 3
    assert 1 <= found["monitors/global/act_absmax"][0] <= 3
    assert found["monitors/layer_01/param_norm"][0] == 1  # every 10: step 0 of 3
    assert found["monitors/layer_01/grad_norm"][1] > 0
    # the checkpointed layers' recompute fired the hooks again, and they were skipped
    assert found["monitors/self/attention_recompute_skipped_count"][1] > 0
