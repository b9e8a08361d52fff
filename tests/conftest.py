"""Without a GPU, Triton kernels run in Triton's CPU interpreter; and no test leaves
files in the checkout.

The interpreter is set before any syncless kernel module imports triton (they import
it lazily, on first use), so CI runs the very kernel code a GPU compiles; on a CUDA
machine the real compiler is used and the interpreter stays off.
"""

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# ---- tests write only under their temporary directories -----------------------------

CHECKOUT = Path(__file__).resolve().parents[1]
# What a test that forgot its tmp_path leaves in the checkout: runs under the default
# root (runs/ of the working directory) and the pages and traces the CLI writes there.
STRAYS = ("syncless-compare.html", "report.html", "trace.json")


def _strays() -> set[str]:
    found = {name for name in STRAYS if (CHECKOUT / name).exists()}
    runs = CHECKOUT / "runs"
    if runs.is_dir():
        found |= {f"runs/{entry.name}" for entry in os.scandir(runs)}
    return found


@pytest.fixture(autouse=True)
def _writes_nothing_in_the_checkout(request: pytest.FixtureRequest):
    """Fail the test that left a run or a page in the checkout (two stat calls and one
    listing a test). A full run once left two ``runs/...-megatron`` directories here."""
    before = _strays()
    yield
    new = sorted(_strays() - before)
    if new:
        pytest.fail(
            f"{request.node.nodeid} wrote {', '.join(new)} into the checkout {CHECKOUT}: "
            "tests write only under tmp_path (pass --run-dir, Run(run_dir=...), -o, or "
            "cwd=tmp_path)",
            pytrace=False,
        )
