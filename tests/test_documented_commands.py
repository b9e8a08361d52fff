"""Every command shown in README.md and docs/ runs here, so the docs cannot drift (#21).

tests/doc_commands.py extracts the commands from the Markdown. Each has an entry in
``RUN`` (a check in tests/doc_checks_demo.py or doc_checks_tools.py that runs it for
real, as a subprocess in a fresh directory, and asserts what the docs promise) or
``SKIP`` here (a one-line reason); a command without an
entry fails ``test_every_documented_command_has_an_entry``. Substitutions (``Ctx.argv``):
a GPU preset becomes ``tiny``, a demo gets ``--steps`` (3 unless its check needs more),
``--nproc-per-node 8`` becomes 2, ``RUN_DIR`` a demo run made once per module,
``my_monitors.py`` and ``src/`` are files made here.
"""

from __future__ import annotations

import re

import doc_checks_demo  # noqa: F401  (registers its checks in RUN)
import doc_checks_tools  # noqa: F401
import doc_commands as dc
import pytest
from doc_commands import RUN, Ctx, shared_run  # noqa: F401  (the checks' fixture)

SKIP: dict[str, str] = {
    'pip install -e ".[report]" && syncless demo': "CI's .ci/run installs the package with the test extra (report included); `syncless demo` runs as its own entry",
    'pip install -e ".[test]" && python -m pytest -q': "CI's .ci/run installs the test extra and runs the suite (this file included)",
    'pip install "syncless[transformers]"': "an install; the test extra CI's .ci/run installs includes it (fsdp2_loop below needs it)",
    'pip install "syncless[lightning]"': "an install; the test extra CI's .ci/run installs includes it",
    'pip install "syncless[megatron]"': "an install; the test extra CI's .ci/run installs includes it",
    'pip install "syncless[torchtitan]"': "an install; the test extra CI's .ci/run installs includes it",
    "torchrun --nproc-per-node 8 -m torchtitan.train --module llama3 --config llama3_debugmodel \\": "8 GPUs and torchtitan's tokenizer and dataset; tests/integrations/test_torchtitan_trainer.py applies the same --override.imports token through torchtitan's own parser",
    'syncless query s3://bucket/runs/llama-70b-0412 "SELECT count(*) FROM metrics"': "a bucket; tests/run/test_object_store.py runs this command on a run in moto's S3",
    'syncless summary s3://bucket/runs/llama-70b-0412': "a bucket; tests/run/test_object_store.py runs this command on a run in moto's S3",
    'syncless check s3://bucket/runs/llama-70b-0412': "a bucket; tests/run/test_object_store.py runs this command on a run in moto's S3",
    'syncless report s3://bucket/runs/llama-70b-0412': "a bucket; tests/run/test_object_store.py runs this command on a run in moto's S3",
    'syncless compact s3://bucket/runs/llama-70b-0412': "a bucket; tests/run/test_object_store.py runs this command on a run in moto's S3",
    "bash .ci/run": "CI itself: a fresh venv and the whole suite, this file included",
    "syncless demo --nproc N": "placeholder N; its twin `syncless demo --nproc 2` runs",
    "torchrun ... -m syncless.demo": "placeholder; its twin `torchrun --nproc-per-node 8 -m syncless.demo ...` runs",
    "syncless lint PATH...": "placeholder PATH; its twin `syncless lint syncless/ my_monitors.py` runs",
    "python -m syncless.capture.simulate TRACE.json": "placeholder; its twin with tests/capture/traces/static.json runs",
    'syncless query RUN_DIR "SELECT ..." --format csv': "placeholder SQL; README's concrete --format csv query runs (and json)",
    "syncless lint: 1 finding in 1 file (12 files checked)": "program output; its form is asserted by `syncless lint syncless/ my_monitors.py`",
    "syncless monitors: budget 1.0% of a 183.7 ms step, stack 0.73%: attention every 7 (2.80 ms per active step, 0.22%); moe every 1 (0.00 ms per active step, 0.00%); activations every 2 (0.44 ms per active step, 0.12%); nonfinite every 2 (0.58 ms per active step, 0.16%); norms every 16 (6.89 ms per active step, 0.23%)": "program output (H200 numbers); its form is asserted by `syncless demo --monitors all`",
}  # fmt: skip


# ---- the table --------------------------------------------------------------------


def test_extract_finds_fenced_prompted_and_wrapped_inline_commands():
    text = "Run `syncless demo\n--quiet` or\n```bash\n$ syncless  check X   # why\nls\n```\n"
    text += "```text\n`syncless lint` inside a fence\n```\n`python -m a` and `pip x`\n"
    found = [(4, "syncless check X"), (1, "syncless demo --quiet"), (10, "python -m a")]
    assert dc.extract(text) == found


def test_every_documented_command_has_an_entry():
    found = dc.documented_commands()
    assert not set(RUN) & set(SKIP)
    missing = [f"{where[0]}: {cmd!r}" for cmd, where in found.items() if cmd not in RUN | SKIP]
    assert not missing, (
        "documented commands without an entry in RUN (a check that runs it) or SKIP (a reason) "
        "in tests/doc_checks_*.py or tests/test_documented_commands.py:\n" + "\n".join(missing)
    )
    stale = sorted((set(RUN) | set(SKIP)) - set(found))
    assert not stale, (
        "entries for commands no longer in the docs (update or remove):\n" + "\n".join(stale)
    )


def params(table: dict) -> list:
    """One test id per command; several ranks are `dist`, the examples and benches `slow`."""
    out = []
    for c in sorted(table):
        marks = [pytest.mark.dist] if re.search(r"--nproc|^torchrun", c) else []
        marks += [pytest.mark.slow] if re.search(r"examples/|bench[/.]", c) else []
        out.append(pytest.param(c, marks=marks, id=c if len(c) <= 100 else c[:97] + "..."))
    return out


@pytest.mark.parametrize("command", params(RUN))
def test_documented_command_runs(command, tmp_path, request):
    RUN[command](Ctx(command, tmp_path, request))


@pytest.mark.parametrize("command", params(SKIP))
def test_documented_command_skipped(command):
    pytest.skip(SKIP[command])
